"""Continuous batching under a token budget: chunked prefill, decodes and preemption."""

from collections import deque
from collections.abc import Callable

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import (
    KVEventSink,
    SequenceFinished,
    SequencePreempted,
    SequenceQueued,
    SequenceResumed,
    discard,
)
from kvscope.engine.core.request import Sequence, SequenceStatus
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput

# The default share of the token budget one prefill chunk may take while other requests
# wait (long_prefill_token_threshold=None): a long prompt then leaves room for the ones
# behind it, which get their first token within a step or two instead of after it.
FAIR_PREFILL_SHARE = 4


class Scheduler:
    """Each sequence just has `num_computed_tokens` catching up with its tokens (vLLM v1).

    Per step: running sequences first (a decode costs one token, an unfinished prefill
    gets its next chunk), then waiting ones in arrival order, while the token budget,
    `max_num_seqs` and free blocks allow. A running sequence that cannot get a block
    preempts the least important running sequence not yet scheduled (possibly itself).

    Invariants: every sequence in `running` holds device blocks and has tokens left to
    compute (or a launched step's placeholder for its next token, with async scheduling);
    a sequence in `waiting` holds none (a swapped one holds CPU blocks). Detached sequences
    (see `detach`) hold blocks outside both; when blocks run short, `reclaim` frees one of
    those (returning it) before anyone running is preempted or a waiting sequence is left
    out.

    Each queue change (queued, resumed, preempted, finished) is reported to `emit`.
    """

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager,
                 reclaim: Callable[[], Sequence | None] = lambda: None,
                 emit: KVEventSink = discard) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.emit = emit
        self.reclaim = reclaim
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queues ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the others."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.emit(SequenceQueued(seq))

    def resume(self, seq: Sequence) -> None:
        """Give back a sequence taken out with `detach` (or a new fork): with its blocks it
        runs again next step; without (they were freed) it recomputes, first in line."""
        self.emit(SequenceResumed(seq))
        if seq.block_table:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of scheduling, blocks and all: it has nothing to
        compute until its owner appends tokens and calls `resume` (or `finish`)."""
        self.running.remove(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks and runs from where the parent is."""
        self.kv_cache.fork(parent, child)
        self.resume(child)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (if there) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        self.kv_cache.drop_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        self.emit(SequenceFinished(seq))

    # ---- one step ----------------------------------------------------------------------
    def prefill_cap(self, others_waiting: bool) -> int | None:
        """The most tokens one prefill chunk may take, or None for no cap.

        long_prefill_token_threshold > 0 caps every chunk (vLLM's knob), 0 never caps, and
        None (the default) caps at a share of the budget only while others wait, so a lone
        long prompt still uses whole steps.
        """
        if not self.config.enable_chunked_prefill:
            return None  # a prompt runs whole or not at all
        threshold = self.config.long_prefill_token_threshold
        if threshold is None:
            if not others_waiting:
                return None
            return max(self.config.max_num_batched_tokens // FAIR_PREFILL_SHARE, 1)
        return threshold or None

    def chunk_size(self, seq: Sequence, budget: int, cap: int | None,
                   num_cached: int = 0) -> int:
        """Tokens to compute next: all that remain (the placeholder of a token a launched
        step will append counts), capped by the budget and the cap."""
        remaining = (seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens
                     - num_cached)
        if cap is not None:
            remaining = min(remaining, cap)
        size = min(remaining, budget)
        if self.config.enable_chunked_prefill:  # a recurrent model's snapshot boundary
            start = seq.num_computed_tokens + num_cached
            size = self.kv_cache.snapshot_chunk_end(start, start + size) - start
        return size

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.prefill_cap(others_waiting=bool(self.waiting))
        preempted: set[int] = set()  # ids of sequences taken out during this loop

        # A snapshot: preemption changes `running`, never the order this loop visits.
        for seq in list(self.running):
            if budget == 0:
                break
            if id(seq) in preempted or self._finishes_by_length(seq):
                continue
            spec = self._spec_tokens(seq, budget)
            num_tokens = self.chunk_size(seq, budget, cap) + len(spec)
            copies = self._allocate(seq, num_tokens, out)
            if copies is None and spec:  # proposals are the first thing to go
                spec, num_tokens = [], num_tokens - len(spec)
                copies = self._allocate(seq, num_tokens, out)
            while copies is None:
                # Among equals the latest in `running` goes: the head of `running` only
                # ever preempts itself when alone, so it always finishes (no livelock).
                victim = max(reversed(self._unscheduled_running(out)),
                             key=lambda s: s.priority_key)
                self.preempt(victim, out)
                preempted.add(id(victim))
                if victim is seq:
                    break
                copies = self.kv_cache.allocate_slots(seq, num_tokens)
            if copies is None:
                continue  # seq preempted itself
            out.block_copies.extend(copies)
            self._add_scheduled(out, seq, num_tokens, spec)
            budget -= num_tokens

        # A step that had to preempt admits nobody: memory is short already.
        num_forking = self._num_pending_forks()
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) + num_forking < self.config.max_num_seqs):
            seq = self.waiting[0]
            # Admitted uncapped: from the next step on it runs capped while others wait.
            # (A first whole chunk also caches its prefix for identical prompts behind it.)
            cap = self.prefill_cap(others_waiting=False)
            if seq.status is SequenceStatus.SWAPPED:
                num_tokens = self.chunk_size(seq, budget, cap)
                swap_in = self.kv_cache.swap_in(seq, num_tokens)
                while swap_in is None and self._reclaim(out):
                    swap_in = self.kv_cache.swap_in(seq, num_tokens)
                if swap_in is None:
                    break
                out.swap_in.extend(swap_in)
                out.swapped_in.append(seq)
            else:
                num_tokens = self._admit_waiting(seq, budget, cap, out)
                if not num_tokens:
                    break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_scheduled(out, seq, num_tokens)
            budget -= num_tokens
        return out

    def _num_pending_forks(self) -> int:
        """Sequences that join `running` when a launched step samples (async scheduling):
        the other n - 1 samples of a request whose prompt that step finishes."""
        return sum(seq.request.num_pending_forks for seq in self.running
                   if seq.num_output_placeholders)

    def _finishes_by_length(self, seq: Sequence) -> bool:
        """A launched step's token will end the sequence at a length limit: nothing to
        schedule after it (EOS and stops are known only once the token is)."""
        return (seq.num_output_placeholders > 0
                and seq.reaches_length_limit(self.config.max_model_len,
                                             seq.num_output_placeholders))

    @staticmethod
    def _spec_tokens(seq: Sequence, budget: int) -> list[int]:
        """A decoding sequence's proposals that fit the budget beside its own token; they
        count against the budget and are verified as one chunk with it."""
        if not seq.spec_token_ids or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        return seq.spec_token_ids[:budget - 1]

    def _allocate(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
                  cached_prefix: list = ()) -> list[tuple[int, int]] | None:
        """allocate_slots, reclaiming detached sequences' blocks while that is short."""
        copies = self.kv_cache.allocate_slots(seq, num_tokens, cached_prefix)
        while copies is None and self._reclaim(out):
            copies = self.kv_cache.allocate_slots(seq, num_tokens, cached_prefix)
        return copies

    def _reclaim(self, out: SchedulerOutput) -> bool:
        """Free one detached sequence's blocks (it recomputes when resumed): a preemption."""
        seq = self.reclaim()
        if seq is None:
            return False
        out.preempted.append(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.emit(SequencePreempted(seq))
        return True

    def _unscheduled_running(self, out: SchedulerOutput) -> list[Sequence]:
        """Preemption candidates: running sequences whose blocks this step does not write."""
        scheduled = {id(item.seq) for item in out.scheduled}
        return [s for s in self.running if id(s) not in scheduled]

    def _admit_waiting(self, seq: Sequence, budget: int, cap: int | None,
                       out: SchedulerOutput) -> int:
        """Blocks for a waiting sequence's next chunk, reusing cached prefix blocks;
        returns the chunk's token count, or 0 if it cannot start this step."""
        cached_prefix = (self.kv_cache.find_cached_prefix(seq)
                         if seq.num_computed_tokens == 0 else [])
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        remaining = seq.num_tokens - seq.num_computed_tokens - num_cached
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0
        num_tokens = self.chunk_size(seq, budget, cap, num_cached)
        copies = self._allocate(seq, num_tokens, out, cached_prefix)
        if copies is None:
            return 0
        if seq.first_scheduled_time is None:
            seq.request.num_cached_tokens = num_cached
        out.block_copies.extend(copies)
        return num_tokens

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_tokens: int,
                       spec_token_ids: list[int] = ()) -> None:
        out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens,
                                               list(spec_token_ids)))
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
        self.emit(SequencePreempted(seq))
