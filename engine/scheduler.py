"""Continuous batching under a token budget: chunked prefill, decodes and preemption."""

from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start, start + num_tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    # Fixed when scheduled: read after the step samples, the sequence's new output token
    # would make a prompt's last one-token chunk look like a decode.
    kind: str = field(init=False)

    def __post_init__(self) -> None:
        self.kind = ("decode" if self.num_tokens == 1 and self.seq.num_output_tokens > 0
                     else "prefill")

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so its logits pick the next one."""
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Block moves the device must do before the forward, in this order:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    preempted: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: int = 0


class Scheduler:
    """Each sequence just has `num_computed_tokens` catching up with its tokens (vLLM v1).

    Per step: running sequences first (a decode costs one token, an unfinished prefill
    gets its next chunk), then waiting ones in arrival order, while the token budget,
    `max_num_seqs` and free blocks allow. A running sequence that cannot get a block
    preempts the least important running sequence (possibly itself).
    """

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.kv_cache.events.sequence_changed(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def chunk_size(self, seq: Sequence, budget: int, num_cached: int = 0) -> int:
        """Tokens to compute next: all that remain, capped by the budget and by
        long_prefill_token_threshold (so several long prompts progress together)."""
        remaining = seq.num_tokens - seq.num_computed_tokens - num_cached
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            remaining = min(remaining, threshold)
        return min(remaining, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()  # their blocks are written this step: never victims

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = self.chunk_size(seq, budget)
            if num_tokens == 0:  # a beam waiting for its siblings' candidates
                index += 1
                continue
            copies = self.kv_cache.allocate_slots(seq, num_tokens)
            while copies is None:
                victim = max((s for s in self.running if s.seq_id not in scheduled_ids),
                             key=lambda s: s.priority_key)
                self.preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv_cache.allocate_slots(seq, num_tokens)
            if copies is None:
                continue  # seq preempted itself; running[index] is now the next one
            out.block_copies.extend(copies)
            self._add_scheduled(out, seq, num_tokens)
            scheduled_ids.add(seq.seq_id)
            budget -= num_tokens
            index += 1

        # A step that had to preempt admits nobody: memory is short already.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.status is SequenceStatus.SWAPPED:
                num_tokens = self.chunk_size(seq, budget)
                swap_in = self.kv_cache.swap_in(seq, num_tokens)
                if swap_in is None:
                    break
                out.swap_in.extend(swap_in)
                out.swapped_in.append(seq)
            else:
                num_tokens = self._admit_waiting(seq, budget, out)
                if not num_tokens:
                    break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if num_tokens:  # (a swapped-in beam may have nothing left: it awaits its siblings)
                self._add_scheduled(out, seq, num_tokens)
            budget -= num_tokens

        if (self.waiting and self.running and not out.scheduled and not out.preempted
                and not out.swapped_in):
            # Only beams awaiting a sibling's candidates run (they compute nothing) and that
            # sibling cannot get blocks: every later step would be this one. Free an idle
            # beam's blocks and queue it behind the blocked head.
            victim = max(self.running, key=lambda s: s.priority_key)
            self.preempt(victim, out)
            self.waiting.remove(victim)
            self.waiting.insert(1, victim)
        return out

    def _admit_waiting(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Blocks for a waiting sequence's next chunk, reusing cached prefix blocks;
        returns the chunk's token count, or 0 if it cannot start this step."""
        cached_prefix = (self.kv_cache.find_cached_prefix(seq)
                         if seq.num_computed_tokens == 0 else [])
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        remaining = seq.num_tokens - seq.num_computed_tokens - num_cached
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0
        num_tokens = self.chunk_size(seq, budget, num_cached)
        copies = self.kv_cache.allocate_slots(seq, num_tokens, cached_prefix)
        if copies is None:
            return 0
        if seq.first_scheduled_time is None:
            seq.request.num_cached_tokens = num_cached
        out.block_copies.extend(copies)
        return num_tokens

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_tokens: int) -> None:
        out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
        out.num_scheduled_tokens += num_tokens

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take the sequence's device blocks and requeue it first. In swap mode its K/V goes
        to the CPU pool; otherwise (or if that pool is full) it recomputes on resume."""
        self.running.remove(seq)
        swap_out = (self.kv_cache.swap_out(seq) if self.config.preemption_mode == "swap"
                    else None)
        if swap_out is None:
            self.kv_cache.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        else:
            out.swap_out.extend(swap_out)
            out.swapped_out.append(seq)
            seq.status = SequenceStatus.SWAPPED
        out.preempted.append(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        self.kv_cache.drop_swapped(seq)
        seq.status = SequenceStatus.FINISHED
