"""Priority scheduling: a hypothesis state machine drives a Scheduler over a real
KVCacheManager (no model: a step's chunks are marked computed and a token is appended), and
after every step the priority invariants hold; plus the refusals of bad priorities."""

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import PreemptionReason, SequencePreempted
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.scheduling_policy import PRIORITY_MAX, PRIORITY_MIN, check_priority
from kvscope.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
AGING_STEPS = 3  # small, so that aging reorders requests within a run
TAKER_REASONS = (PreemptionReason.PRIORITY, PreemptionReason.MAX_NUM_SEQS)


class PriorityMachine(RuleBasedStateMachine):
    """Requests of priorities 0-3 arrive between steps into a pool of a few blocks, with few
    seats and a small budget, so every kind of preemption happens."""

    def __init__(self) -> None:
        super().__init__()
        self.config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=12,
                                   max_model_len=40, max_num_seqs=3,
                                   enable_prefix_caching=False, scheduling_policy="priority",
                                   priority_aging_steps=AGING_STEPS)
        self.kv_cache = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE,
                                       enable_caching=False)
        self.events: list[SequencePreempted] = []
        self.scheduler = Scheduler(self.config, self.kv_cache, emit=self._listen)
        self.ids = itertools.count()
        self.arrival_step: dict[str, int] = {}
        self.unfinished: list[Sequence] = []

    def _listen(self, event) -> None:
        if isinstance(event, SequencePreempted):
            self.events.append(event)

    @rule(priority=st.integers(0, 3), prompt_len=st.integers(1, 14),
          max_tokens=st.integers(1, 10))
    def arrive(self, priority: int, prompt_len: int, max_tokens: int) -> None:
        request_id = f"r{next(self.ids)}"
        request = Request(request_id, None, list(range(1, prompt_len + 1)),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival_time=float(len(self.arrival_step)), priority=priority)
        seq = Sequence(request_id, request, 0, list(request.prompt_token_ids), prompt_len)
        request.sequences.append(seq)
        self.arrival_step[request_id] = self.scheduler.num_steps
        self.scheduler.add(seq)
        self.unfinished.append(seq)

    @rule()
    def step(self) -> None:
        waiting_before = list(self.scheduler.waiting)
        self.events.clear()
        out = self.scheduler.schedule()
        self._check_step(out, waiting_before)
        for item in out.scheduled:  # what the forward and the sampler would do
            seq = item.seq
            seq.num_computed_tokens = item.end
            if item.end == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.reaches_length_limit(self.config.max_model_len):
                    self.scheduler.finish(seq)
                    self.unfinished.remove(seq)

    def _check_step(self, out, waiting_before: list[Sequence]) -> None:
        assert [e.seq for e in self.events] == out.preempted
        preempted = {id(seq) for seq in out.preempted}
        admitted = [item.seq for item in out.scheduled
                    if any(item.seq is seq for seq in waiting_before)]
        still_waiting = [seq for seq in self.scheduler.waiting if id(seq) not in preempted]
        scheduled = {id(item.seq) for item in out.scheduled}
        for event in self.events:
            assert event.blocks_freed >= 0 and event.tokens_lost >= 0
            if event.reason in TAKER_REASONS:  # only ever for a request ranked ahead
                assert event.taker.priority_key < event.seq.priority_key
                assert any(event.taker is seq for seq in waiting_before)
            # Nobody is preempted for a taker that then does not run: a preemption that
            # could not make the room is never made.
            if event.taker is not event.seq:
                assert id(event.taker) in scheduled, (event, out)
        # Admission follows rank: nobody still waiting ranks ahead of an admitted one.
        for new in admitted:
            for seq in still_waiting:
                assert seq.priority_key > new.priority_key
                # The documented aging bound, from the priorities and arrival steps alone.
                overtake = self.arrival_step[new.seq_id] - self.arrival_step[seq.seq_id]
                assert overtake <= 0 or overtake <= (
                    (seq.request.priority - new.request.priority) * AGING_STEPS)
        # A waiting request ranked ahead of a running one is there only because the budget
        # was spent, memory was short (a running one's growth preempted), or it, or one
        # ranked ahead of it (admission follows rank), would not fit its whole remaining
        # prompt even with every running one ranked behind it freed: a free seat, a
        # lower-ranked holder of blocks or of budget never keeps it out.
        memory_short = any(e.reason is PreemptionReason.KV_FULL for e in self.events)
        budget_spent = out.num_scheduled_tokens == self.config.max_num_batched_tokens
        too_big = False
        for seq in sorted(still_waiting, key=lambda s: s.priority_key):
            behind = [running for running in self.scheduler.running
                      if running.priority_key > seq.priority_key]
            could_free = self.kv_cache.num_free_blocks + self.kv_cache.blocks_freed_by(behind)
            too_big = too_big or self.kv_cache.blocks_needed(seq.num_tokens) > could_free
            if behind:
                assert memory_short or budget_spent or too_big, (seq.seq_id, out)

    @invariant()
    def queues_hold_what_they_should(self) -> None:
        scheduler = self.scheduler
        keys = [seq.priority_key for seq in scheduler.waiting]
        assert keys == sorted(keys)
        assert all(seq.block_table for seq in scheduler.running)
        assert all(not seq.block_table for seq in scheduler.waiting)
        assert len(scheduler.running) <= self.config.max_num_seqs
        held = {b for seq in scheduler.running for b in seq.block_table}
        assert self.kv_cache.pool.num_used_blocks == len(held)

    def teardown(self) -> None:
        """No starvation, no livelock: with no new arrivals everything finishes."""
        for _ in range(400):
            if not self.unfinished:
                break
            self.step()
        assert not self.unfinished
        assert self.kv_cache.pool.num_used_blocks == 0


PriorityMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_priority_invariants = PriorityMachine.TestCase


def test_a_high_priority_arrival_preempts_for_a_seat_and_the_victim_keeps_its_place():
    """max_num_seqs=2, both seats held by priority 5: a priority 0 arrival takes the later
    one's seat at once; the victim waits ahead of a later arrival of its own priority."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, max_model_len=64,
                          max_num_seqs=2, enable_prefix_caching=False,
                          scheduling_policy="priority")
    scheduler = Scheduler(config, KVCacheManager(num_blocks=32, block_size=4,
                                                 enable_caching=False))
    first, second, urgent, late = (
        Sequence(f"s{i}", Request(f"s{i}", None, [1, 2, 3], SamplingParams(),
                                  arrival_time=float(i), priority=p), 0, [1, 2, 3], 3)
        for i, p in enumerate((5, 5, 0, 5)))
    scheduler.add(first)
    scheduler.add(second)
    for item in scheduler.schedule().scheduled:  # the prompts ran
        item.seq.num_computed_tokens = item.end
    scheduler.add(urgent)
    scheduler.add(late)

    out = scheduler.schedule()

    (event,) = out.preemptions
    assert (event.seq, event.reason, event.taker) == (second, PreemptionReason.MAX_NUM_SEQS,
                                                       urgent)
    assert event.blocks_freed == 1 and event.tokens_lost == 3
    assert [item.seq for item in out.scheduled] == [urgent, first]
    assert list(scheduler.waiting) == [second, late]


@pytest.mark.parametrize(("priority", "policy", "words"), [
    (1.5, "priority", "must be an integer"), (True, "priority", "must be an integer"),
    ("1", "priority", "must be an integer"), (PRIORITY_MAX + 1, "priority", "outside"),
    (PRIORITY_MIN - 1, "priority", "outside"), (2, "fcfs", "scheduling_policy='priority'")])
def test_bad_priorities_are_refused_naming_the_field(priority, policy, words):
    with pytest.raises(ValueError, match="priority") as error:
        check_priority(priority, policy)
    assert words in str(error.value)


def test_fcfs_takes_the_default_priority():
    assert check_priority(0, "fcfs") == 0 and check_priority(-7, "priority") == -7


def _priority_scheduler(num_blocks: int, max_num_batched_tokens: int) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=64, enable_prefix_caching=False,
                          scheduling_policy="priority")
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=4,
                                            enable_caching=False))


def _arrive(scheduler: Scheduler, name: str, priority: int, prompt_len: int) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    seq = Sequence(name, Request(name, None, prompt, SamplingParams(),
                                 arrival_time=float(scheduler.num_steps), priority=priority),
                   0, list(prompt), prompt_len)
    scheduler.add(seq)
    return seq


def _run(out) -> None:
    """What the forward and the sampler would do with a step: chunks computed, a token
    sampled where a chunk reached the end."""
    for item in out.scheduled:
        item.seq.num_computed_tokens = item.end
        if item.end == item.seq.num_tokens:
            item.seq.token_ids.append(7)


def test_a_waiting_request_preempts_nobody_when_all_it_may_preempt_would_not_make_room():
    """6 blocks: `ahead` (priority 0) holds 4, `behind` (priority 5) 1. A priority 1 prompt
    needing 3 blocks could have only 2 even with `behind` preempted: it waits, and
    `behind` keeps its work."""
    scheduler = _priority_scheduler(num_blocks=6, max_num_batched_tokens=64)
    ahead, behind = _arrive(scheduler, "ahead", 0, 15), _arrive(scheduler, "behind", 5, 3)
    _run(scheduler.schedule())
    taker = _arrive(scheduler, "taker", 1, 12)

    out = scheduler.schedule()

    assert out.preemptions == []
    assert [item.seq for item in out.scheduled] == [ahead, behind]
    assert list(scheduler.waiting) == [taker]


def test_a_growing_request_preempts_itself_when_the_ones_behind_it_would_not_make_room():
    """5 blocks: `first` (priority -1) and `behind` (priority 5) hold one each, `long`
    (priority 0) 3 after its first chunk; its next chunk wants 2 more, and `behind` has only
    1 to give: `long` goes at once, and `behind` runs on."""
    scheduler = _priority_scheduler(num_blocks=5, max_num_batched_tokens=12)
    first, behind = _arrive(scheduler, "first", -1, 2), _arrive(scheduler, "behind", 5, 3)
    _run(scheduler.schedule())
    long = _arrive(scheduler, "long", 0, 20)
    _run(scheduler.schedule())
    assert long.num_computed_tokens == 11 and scheduler.kv_cache.num_free_blocks == 0

    out = scheduler.schedule()

    (event,) = out.preemptions
    assert (event.seq, event.reason, event.taker) == (long, PreemptionReason.KV_FULL, long)
    assert [item.seq for item in out.scheduled] == [first, behind]
