"""Preemption by recompute and by swap: same outputs as an uncontended run, nothing leaked."""

import random
from collections import defaultdict

import pytest

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import GiB

BLOCK_SIZE = 8
MAX_MODEL_LEN = 72
_rng = random.Random(13)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (5, 16, 40, 33, 20, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True, n=2)
PARAMS = [GREEDY, SEEDED] * 3


def completions(run) -> list[list[list[int]]]:
    return [[c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in run.outputs]


@pytest.fixture(scope="module")
def uncontended(make_engine, run_engine):
    return completions(run_engine(
        make_engine("llama", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN),
        PROMPTS, PARAMS))


def pressured_engine(make_engine, **knobs):
    """Nine blocks of eight: one sequence at max_model_len fits, the batch needs ~60."""
    knobs = {"block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
             "num_gpu_blocks_override": 9, "swap_space": 0.001, **knobs}
    return make_engine("llama", **knobs)


def assert_nothing_held(engine):
    kv_cache = engine.kv_cache
    assert kv_cache.pool.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(kv_cache.free_swap_blocks) == kv_cache.num_swap_blocks
    assert sorted(kv_cache.free_swap_blocks) == list(range(kv_cache.num_swap_blocks))


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_repeated_preemption_changes_no_output(preemption_mode, enable_prefix_caching, budget,
                                               make_engine, run_engine, uncontended):
    engine = pressured_engine(make_engine, preemption_mode=preemption_mode,
                              enable_prefix_caching=enable_prefix_caching,
                              max_num_batched_tokens=budget)
    run = run_engine(engine, PROMPTS, PARAMS)

    assert completions(run) == uncontended
    preemptions = [o.metrics.num_preemptions for o in run.outputs]
    assert max(preemptions) >= 2  # repeatedly, not once
    assert sum(preemptions) == engine.scheduler.num_preemptions
    assert sum(len(r.preempted) for r in run.records) == engine.scheduler.num_preemptions
    assert_nothing_held(engine)

    swaps = engine.kv_cache.swap_stats
    swapped_out = sum(len(r.swapped_out) for r in run.records)
    swapped_in = sum(len(r.swapped_in) for r in run.records)
    assert (swaps.swap_outs, swaps.swap_ins) == (swapped_out, swapped_in)
    assert (sum(r.num_blocks_swapped_out for r in run.records),
            sum(r.num_blocks_swapped_in for r in run.records)) == (swaps.blocks_out,
                                                                   swaps.blocks_in)
    if preemption_mode == "swap":
        assert swaps.swap_outs > 0 and swaps.swap_ins == swaps.swap_outs
        assert swaps.blocks_in == swaps.blocks_out > 0
    else:
        assert swaps.swap_outs == swaps.swap_ins == 0


def test_a_full_swap_pool_falls_back_to_recompute(make_engine, run_engine, uncontended):
    probe = pressured_engine(make_engine, preemption_mode="swap")
    bytes_per_block = probe.memory_plan.bytes_per_block
    # Room for three blocks: small sequences swap, bigger ones are recomputed.
    engine = pressured_engine(make_engine, preemption_mode="swap",
                              swap_space=3 * bytes_per_block / GiB)
    assert engine.kv_cache.num_swap_blocks == 3
    run = run_engine(engine, PROMPTS, PARAMS)

    assert completions(run) == uncontended
    preempted = sum(len(r.preempted) for r in run.records)
    swapped = sum(len(r.swapped_out) for r in run.records)
    assert 0 < swapped < preempted
    assert_nothing_held(engine)


@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_step_records_account_for_every_token_and_preemption(
        preemption_mode, enable_prefix_caching, make_engine, run_engine):
    """Per sequence, the chunks run contiguously from 0, except that after a preemption a
    recomputed sequence starts again (at 0, or at a whole block its prefix cache still
    holds) and a swapped one resumes where it was. A step that preempts admits nobody."""
    budget = 16
    engine = pressured_engine(make_engine, preemption_mode=preemption_mode,
                              enable_prefix_caching=enable_prefix_caching,
                              max_num_batched_tokens=budget)
    greedy = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS)
    run = run_engine(engine, PROMPTS, greedy)
    prompt_length = {o.request_id: len(p) for o, p in zip(run.outputs, PROMPTS)}

    positions: dict[str, int] = defaultdict(int)
    computed: dict[str, int] = defaultdict(int)
    recomputed: dict[str, int] = defaultdict(int)
    preempted_by: dict[str, str] = {}
    started: set[str] = set()
    for record in run.records:
        assert record.num_scheduled_tokens <= budget
        assert set(record.swapped_out) <= set(record.preempted)
        for _, seq_id, _, start, end in record.chunks:
            length = end - start
            how = preempted_by.pop(seq_id, None)
            if how == "recompute":
                assert start % BLOCK_SIZE == 0 and start < positions[seq_id]
                if not enable_prefix_caching:
                    assert start == 0
                recomputed[seq_id] += positions[seq_id] - start
            else:
                assert start == positions[seq_id]
            if record.preempted:
                assert seq_id in started  # nobody new starts in a step that preempted
            started.add(seq_id)
            positions[seq_id] = end
            computed[seq_id] += length
        for seq_id in record.preempted:
            preempted_by[seq_id] = "swap" if seq_id in record.swapped_out else "recompute"

    assert recomputed or preemption_mode == "swap"
    for output in run.outputs:
        seq_id = output.request_id
        total = prompt_length[seq_id] + len(output.outputs[0].token_ids) - 1
        assert positions[seq_id] == total
        assert computed[seq_id] == total + recomputed[seq_id]


def test_the_victim_is_the_least_important_running_request(make_engine):
    """Later arrivals are preempted first, unless a request has a larger priority value."""
    for priorities, victim in (((0, 0), 1), ((5, 0), 0)):
        engine = make_engine("llama", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                             num_gpu_blocks_override=9, scheduling_policy="priority")
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        ids = [engine.add_request(PROMPTS[i], params, priority=p).request_id
               for i, p in zip((1, 4), priorities)]
        preempted = []
        while engine.has_unfinished_requests():
            preempted += engine.step().record.preempted
        assert preempted and preempted[0] == ids[victim]
