"""Every preemption carries its reason, victim, taker, blocks freed and computed tokens lost,
checked against what the steps' chunks show, and survives the session log's round trip."""

import random
from collections import defaultdict

import pytest
from conftest import session_log_round_trip

from kvscope.engine.core.kv_events import PreemptionReason
from kvscope.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
LOW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def contended_run(make_engine, max_num_seqs: int):
    """Low-priority requests fill a small pool (and, with two seats, every seat);
    high-priority ones arrive while they run."""
    engine = make_engine("llama", block_size=BLOCK_SIZE, num_gpu_blocks_override=14,
                         max_model_len=48, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=32, enable_prefix_caching=False,
                         scheduling_policy="priority")
    rng = random.Random(5)

    def prompt(n):
        return [rng.randrange(1, 256) for _ in range(n)]

    for _ in range(3):
        engine.add_request(prompt(14), LOW, priority=2)
    records, arrivals = [], iter([3, 6, 9, 12])
    next_arrival = next(arrivals)
    while engine.has_unfinished_requests() or next_arrival is not None:
        if next_arrival is not None and len(records) == next_arrival:
            engine.add_request(prompt(10), HIGH, priority=0)
            next_arrival = next(arrivals, None)
        records.append(engine.step().record)
    return engine, records


@pytest.fixture(scope="module")
def contended_runs(make_engine):
    """Two seats (the high-priority arrivals need a seat) and four (they need blocks)."""
    return [contended_run(make_engine, seats) for seats in (2, 4)]


def test_each_preemption_says_why_for_whom_and_what_it_cost(contended_runs):
    reasons = set()
    for engine, records in contended_runs:
        reasons |= checked_reasons(engine, records)
    assert reasons == {"kv_full", "priority", "max_num_seqs"}


def checked_reasons(engine, records) -> set[str]:
    computed = defaultdict(int)  # per sequence, the tokens computed so far (its K/V)
    reasons = set()
    for record in records:
        live = {seq_id for _, seq_id, *_ in record.chunks}
        assert [cause[0] for cause in record.preemptions] == list(record.preempted)
        for victim, reason, taker, blocks_freed, tokens_lost in record.preemptions:
            reasons.add(reason)
            assert tokens_lost == computed[victim] > 0
            assert blocks_freed == -(-tokens_lost // BLOCK_SIZE)  # nothing shared here
            if reason != PreemptionReason.KV_FULL:  # a taker ranked ahead, started now
                assert taker in live and taker != victim
            computed[victim] = 0
        for _, seq_id, _, start, end in record.chunks:
            assert start == computed[seq_id]
            computed[seq_id] = end
    assert sum(len(r.preemptions) for r in records) == engine.scheduler.num_preemptions
    return reasons


def test_preemption_causes_round_trip_the_session_log(contended_runs, tmp_path):
    engine, records = contended_runs[0]
    stored = session_log_round_trip(records, engine.config.to_dict(), tmp_path)
    assert stored == records and any(r.preemptions for r in stored)
