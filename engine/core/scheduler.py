"""Continuous batching under a token budget: chunked prefill, decodes and preemption."""

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import (
    KVEventSink,
    PreemptionReason,
    PrefixMiss,
    SequenceFinished,
    SequencePreempted,
    SequenceQueued,
    SequenceResumed,
    discard,
)
from kvscope.engine.core.request import Sequence, SequenceStatus
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.core.scheduling_policy import RankedQueue, rank

# The default share of the token budget one prefill chunk may take while other requests
# wait (long_prefill_token_threshold=None): a long prompt then leaves room for the ones
# behind it, which get their first token within a step or two instead of after it.
FAIR_PREFILL_SHARE = 4


class Scheduler:
    """Each sequence just has `num_computed_tokens` catching up with its tokens (vLLM v1).

    Per step under fcfs: running sequences first (a decode costs one token, an unfinished
    prefill gets its next chunk), then waiting ones in arrival order, while the token
    budget, `max_num_seqs` and free blocks allow. Under priority: all of them in rank order
    (engine.core.scheduling_policy; both queues are kept in that order as sequences join
    them, so a step merges them instead of sorting), and a waiting sequence short of a seat
    or of blocks preempts the least important running ones ranked behind it. A running
    sequence that cannot get a block preempts the least important running sequence not yet
    scheduled (possibly itself). A preemption is made only when the victims it would go on
    to take could make the room: a taker that could not get in even with all of them freed
    preempts nobody (a running one then preempts itself). Every preemption is a
    SequencePreempted event: why, for whom, what it freed and what it lost.

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
        # A tier below the pool (engine.core.kv_offload) may take a waiting sequence out of
        # the queue while it loads more of its prefix (True), given the blocks the pool has.
        self.fetch_prefix: Callable[[Sequence, int], bool] = lambda seq, num_cached: False
        self.waiting: deque[Sequence] | RankedQueue = (
            RankedQueue() if config.scheduling_policy == "priority" else deque())
        # Under priority kept in rank order (bisect-inserted, see _start_running).
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock of priority aging

    # ---- queues ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence: behind the others, or at its rank under priority."""
        seq.request.rank = rank(seq.request, self.config.scheduling_policy,
                                self.config.priority_aging_steps, self.num_steps)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.emit(SequenceQueued(seq))

    def resume(self, seq: Sequence) -> None:
        """Give back a sequence taken out with `detach` (or a new fork): with its blocks it
        runs again next step; without (they were freed) it recomputes, first in line."""
        self.emit(SequenceResumed(seq))
        if seq.block_table:
            self._start_running(seq)
        else:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if self.config.scheduling_policy == "priority":  # after its equals: arrival order
            bisect.insort(self.running, seq, key=_priority_key)
        else:
            self.running.append(seq)

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
        self.num_steps += 1
        out = SchedulerOutput()
        step = _StepState(self.config.max_num_batched_tokens)
        cap = self.prefill_cap(others_waiting=bool(self.waiting))
        if self.config.scheduling_policy == "priority":
            # One pass in rank order: a waiting sequence ranked ahead of running ones takes
            # the token budget before them, and their seats and blocks if it must.
            for seq in self._in_rank_order(step):
                if step.budget == 0:
                    break
                if id(seq) in step.preempted:
                    continue
                if seq.status is SequenceStatus.RUNNING:
                    self._schedule_running(seq, cap, out, step)
                else:
                    # The first that cannot start holds back those ranked behind it.
                    step.admitting = self._admit(seq, out, step)
            return out
        # A snapshot: preemption changes `running`, never the order this loop visits.
        for seq in list(self.running):
            if step.budget == 0:
                break
            if id(seq) not in step.preempted:
                self._schedule_running(seq, cap, out, step)
        while self.waiting and step.budget > 0 and self._admit(self.waiting[0], out, step):
            pass
        return out

    def _in_rank_order(self, step: "_StepState") -> Iterator[Sequence]:
        """Running and waiting sequences merged in rank order (running first among
        equals), as they stood when the step began; the waiting stop once one is held back
        (step.admitting), so a step visits the running and the few it admits, never the
        whole queue."""
        running, waiting = list(self.running), list(self.waiting)  # both in rank order
        next_waiting = 0
        for seq in running:
            key = seq.priority_key
            while (step.admitting and next_waiting < len(waiting)
                   and waiting[next_waiting].priority_key < key):
                next_waiting += 1
                yield waiting[next_waiting - 1]
            yield seq
        while step.admitting and next_waiting < len(waiting):
            next_waiting += 1
            yield waiting[next_waiting - 1]

    def _schedule_running(self, seq: Sequence, cap: int | None, out: SchedulerOutput,
                          step: "_StepState") -> None:
        """A running sequence's next chunk; when blocks run short, the least important
        running sequence not yet scheduled is preempted (possibly this one)."""
        if self._finishes_by_length(seq):
            return
        spec = self._spec_tokens(seq, step.budget)
        num_tokens = self.chunk_size(seq, step.budget, cap) + len(spec)
        copies = self._allocate(seq, num_tokens, out)
        if copies is None and spec:  # proposals are the first thing to go
            spec, num_tokens = [], num_tokens - len(spec)
            copies = self._allocate(seq, num_tokens, out)
        if copies is None:
            copies = self._preempt_for_growth(seq, num_tokens, out, step)
            if copies is None:
                return  # it was preempted itself
        out.block_copies.extend(copies)
        self._add_scheduled(out, seq, num_tokens, spec)
        step.budget -= num_tokens

    def _preempt_for_growth(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
                            step: "_StepState") -> list[tuple[int, int]] | None:
        """Blocks for a running sequence's next chunk by preempting the least important
        running sequences not yet scheduled, until it fits: its block copies, or None if
        it was the one preempted. Only those ranked behind it are candidates; if freeing
        all of them would still leave it short, it goes at once and they keep their
        work."""
        # Behind it: ranked after it, or its equal later in `running` (a fork).
        unscheduled = self._unscheduled_running(out)
        at = next(i for i, other in enumerate(unscheduled) if other is seq)
        behind = [s for i, s in enumerate(unscheduled) if s is not seq and (
            s.priority_key > seq.priority_key or s.priority_key == seq.priority_key and i > at)]
        short = self.kv_cache.free_blocks_wanted(seq, num_tokens) - self.kv_cache.num_free_blocks
        if self.kv_cache.blocks_freed_by(behind) < short:
            behind = []
        for victim in self._victim_order(behind):
            self._preempt_for(victim, seq, out, step, PreemptionReason.KV_FULL)
            copies = self.kv_cache.allocate_slots(seq, num_tokens)
            if copies is not None:
                return copies
        self._preempt_for(seq, seq, out, step, PreemptionReason.KV_FULL)
        return None

    @staticmethod
    def _victim_order(candidates: list[Sequence]) -> list[Sequence]:
        """Who of the candidates (all ranked behind the one that needs the room) is
        preempted first: the last ranked (vLLM's rule: the lowest priority, then the latest
        arrival), and among equals the latest in `running`. The first-ranked running
        sequence is so only ever preempted by itself, when alone, and always finishes (no
        livelock). Not whoever has the fewest computed tokens: under priority that is often
        an earlier arrival just resumed, which, requeued at its rank ahead of later ones
        still running, preempts one of them next step (on bench/priority.py's trace it
        doubled the preemptions)."""
        return sorted(reversed(candidates), key=_priority_key, reverse=True)

    def _preempt_for(self, victim: Sequence, taker: Sequence, out: SchedulerOutput,
                     step: "_StepState", reason: PreemptionReason) -> None:
        self.preempt(victim, out, reason, taker)
        step.preempted.add(id(victim))

    def _admit(self, seq: Sequence, out: SchedulerOutput, step: "_StepState") -> bool:
        """Start (or swap back in) a waiting sequence; False if it cannot this step (True
        also when it left the queue while the disk tier loads its prefix). A step that
        preempted for lack of blocks admits nobody: memory is short already."""
        if any(p.reason is PreemptionReason.KV_FULL for p in out.preemptions):
            return False
        behind = self._ranked_behind(seq, out)
        seats_short = (len(self.running) + self._num_pending_forks() + 1
                       - self.config.max_num_seqs)
        if len(behind) < seats_short:
            return False
        # Admitted uncapped: from the next step on it runs capped while others wait.
        # (A first whole chunk also caches its prefix for identical prompts behind it.)
        cap = self.prefill_cap(others_waiting=False)
        swapped = seq.status is SequenceStatus.SWAPPED
        if swapped:
            num_tokens, cached_prefix, miss = self.chunk_size(seq, step.budget, cap), [], None
        else:
            planned = self._plan_waiting(seq, step.budget, cap)
            if planned is None:  # its prefix is loading: the ones behind it go on
                self.waiting.remove(seq)
                return True
            num_tokens, cached_prefix, miss = planned
            if not num_tokens:
                return False
        if behind and not self._room_with(behind, seq, num_tokens, cached_prefix):
            if seats_short > 0:
                return False
            behind = []  # freeing them all would not let it in: it preempts nobody
        victims = self._victim_order(behind)
        for _ in range(seats_short):
            self._preempt_for(victims.pop(0), seq, out, step, PreemptionReason.MAX_NUM_SEQS)

        def make_room() -> bool:
            if self._reclaim(out, seq):
                return True
            if not victims:
                return False
            self._preempt_for(victims.pop(0), seq, out, step, PreemptionReason.PRIORITY)
            return True

        if swapped:
            swap_in = self.kv_cache.swap_in(seq, num_tokens)
            while swap_in is None and make_room():
                swap_in = self.kv_cache.swap_in(seq, num_tokens)
            if swap_in is None:
                return False
            out.swap_in.extend(swap_in)
            out.swapped_in.append(seq)
        elif not self._allocate_waiting(seq, num_tokens, cached_prefix, miss, out, make_room):
            return False
        self.waiting.remove(seq)
        self._start_running(seq)
        self._add_scheduled(out, seq, num_tokens)
        step.budget -= num_tokens
        return True

    def _room_with(self, victims: list[Sequence], taker: Sequence, num_tokens: int,
                   cached_prefix: list) -> bool:
        """Whether the free blocks and those that freeing all the victims returns cover
        the taker's admission (the blocks detached sequences would give back are not
        counted)."""
        kv = self.kv_cache
        if taker.status is SequenceStatus.SWAPPED:
            wanted = kv.swap_in_blocks_wanted(taker, num_tokens)
        else:
            wanted = kv.free_blocks_wanted(taker, num_tokens, cached_prefix)
        kept = [block for positions in cached_prefix for block in positions
                if block is not None]
        return kv.num_free_blocks + kv.blocks_freed_by(victims, kept) >= wanted

    def _ranked_behind(self, taker: Sequence, out: SchedulerOutput) -> list[Sequence]:
        """Under the priority policy, the running sequences not scheduled this step that
        rank behind `taker`: those it may preempt. None under fcfs, where waiting never
        displaces running."""
        if self.config.scheduling_policy != "priority":
            return []
        return [s for s in self._unscheduled_running(out)
                if s.priority_key > taker.priority_key]

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
                  cached_prefix: list = (),
                  make_room: Callable[[], bool] | None = None) -> list[tuple[int, int]] | None:
        """allocate_slots, calling make_room while that is short (by default: reclaiming
        detached sequences' blocks)."""
        make_room = make_room or (lambda: self._reclaim(out, seq))
        copies = self.kv_cache.allocate_slots(seq, num_tokens, cached_prefix)
        while copies is None and make_room():
            copies = self.kv_cache.allocate_slots(seq, num_tokens, cached_prefix)
        return copies

    def _reclaim(self, out: SchedulerOutput, taker: Sequence) -> bool:
        """Free one detached sequence's blocks for `taker` (the freed one recomputes when
        resumed, from no computed tokens): a preemption."""
        free_before = self.kv_cache.num_free_blocks
        seq = self.reclaim()
        if seq is None:
            return False
        self._record_preemption(seq, out, SequencePreempted(
            seq, PreemptionReason.KV_FULL, taker, self.kv_cache.num_free_blocks - free_before,
            seq.num_computed_tokens))
        seq.num_computed_tokens = 0
        return True

    def _unscheduled_running(self, out: SchedulerOutput) -> list[Sequence]:
        """Preemption candidates: running sequences whose blocks this step does not write."""
        scheduled = {id(item.seq) for item in out.scheduled}
        return [s for s in self.running if id(s) not in scheduled]

    def _plan_waiting(self, seq: Sequence, budget: int, cap: int | None,
                      ) -> tuple[int, list, PrefixMiss | None] | None:
        """A waiting sequence's next chunk: its token count (0 if it cannot start this
        step), the cached prefix blocks it reuses and why that prefix ended short; None if
        it left the queue while its prefix loads (fetch_prefix)."""
        fresh = seq.num_computed_tokens == 0
        cached_prefix = self.kv_cache.find_cached_prefix(seq) if fresh else []
        if fresh and self.fetch_prefix(seq, len(cached_prefix)):
            return None
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        remaining = seq.num_tokens - seq.num_computed_tokens - num_cached
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0, cached_prefix, None
        # Read before allocating: the allocation may evict what it would explain.
        miss = self.kv_cache.explain_miss(seq, len(cached_prefix)) if fresh else None
        return self.chunk_size(seq, budget, cap, num_cached), cached_prefix, miss

    def _allocate_waiting(self, seq: Sequence, num_tokens: int, cached_prefix: list,
                          miss: PrefixMiss | None, out: SchedulerOutput,
                          make_room: Callable[[], bool]) -> bool:
        """Blocks for a waiting sequence's planned chunk, reusing its cached prefix; False
        if the pool cannot give them even with make_room."""
        copies = self._allocate(seq, num_tokens, out, cached_prefix, make_room)
        if copies is None:
            return False
        if seq.first_scheduled_time is None:
            seq.request.num_cached_tokens = len(cached_prefix) * self.kv_cache.block_size
        if miss is not None:
            out.prefix_misses.append(miss)
            self.emit(miss)
        out.block_copies.extend(copies)
        return True

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_tokens: int,
                       spec_token_ids: list[int] = ()) -> None:
        out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens,
                                               list(spec_token_ids)))
        out.num_scheduled_tokens += num_tokens

    def preempt(self, seq: Sequence, out: SchedulerOutput,
                reason: PreemptionReason = PreemptionReason.KV_FULL,
                taker: Sequence | None = None) -> None:
        """Take the sequence's device blocks for `taker` (by default itself) and requeue it
        (first under fcfs; at its rank under priority). In swap mode its K/V goes to the CPU
        pool; otherwise (or if that pool is full) it recomputes on resume."""
        self.running.remove(seq)
        free_before, computed = self.kv_cache.num_free_blocks, seq.num_computed_tokens
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
        self.waiting.appendleft(seq)
        self._record_preemption(seq, out, SequencePreempted(
            seq, reason, taker or seq, self.kv_cache.num_free_blocks - free_before,
            0 if swap_out is not None else computed))

    def _record_preemption(self, seq: Sequence, out: SchedulerOutput,
                           event: SequencePreempted) -> None:
        out.preempted.append(seq)
        out.preemptions.append(event)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.emit(event)


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return seq.priority_key


@dataclass(slots=True)
class _StepState:
    """What one schedule() call tracks as it goes."""

    budget: int  # tokens still free this step
    preempted: set[int] = field(default_factory=set)  # ids of sequences taken out
    admitting: bool = True  # under priority: no waiting sequence was held back yet
