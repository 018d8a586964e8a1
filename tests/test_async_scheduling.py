"""Async scheduling (EngineConfig.async_scheduling): the forward runs on a thread of its own
while the engine schedules the next step, and outputs, preemption, stops and aborts stay
exactly what a synchronous engine gives."""

import asyncio
import itertools
import threading

import pytest
from test_preemption import BLOCK_SIZE, GREEDY, MAX_MODEL_LEN, PARAMS, PROMPTS, completions
from test_preemption import assert_nothing_held as assert_pool_idle

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams


def engine_for(make_engine, async_scheduling: bool, **knobs) -> EngineCore:
    knobs = {"block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, **knobs}
    return make_engine("llama", async_scheduling=async_scheduling, **knobs)


def assert_nothing_held(engine: EngineCore) -> None:
    assert_pool_idle(engine)
    assert not engine.has_unfinished_requests()  # no forward left running either


@pytest.fixture(scope="module")
def synchronous(make_engine, run_engine):
    return completions(run_engine(engine_for(make_engine, False), PROMPTS, PARAMS))


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_outputs_under_repeated_preemption_are_the_synchronous_ones(
        preemption_mode, enable_prefix_caching, budget, make_engine, run_engine, synchronous):
    # Nine blocks of eight: one sequence at max_model_len fits, the batch needs ~60.
    engine = engine_for(make_engine, True, num_gpu_blocks_override=9, swap_space=0.001,
                        preemption_mode=preemption_mode, max_num_batched_tokens=budget,
                        enable_prefix_caching=enable_prefix_caching)
    run = run_engine(engine, PROMPTS, PARAMS)

    assert completions(run) == synchronous
    preemptions = [o.metrics.num_preemptions for o in run.outputs]
    assert max(preemptions) >= 2
    assert sum(preemptions) == engine.scheduler.num_preemptions
    assert sum(len(r.preempted) for r in run.records) == engine.scheduler.num_preemptions
    swaps = engine.kv_cache.swap_stats
    assert (sum(r.num_blocks_swapped_out for r in run.records),
            sum(r.num_blocks_swapped_in for r in run.records)) == (swaps.blocks_out,
                                                                   swaps.blocks_in)
    assert (swaps.blocks_out > 0) == (preemption_mode == "swap")
    assert_nothing_held(engine)


def test_runs_are_deterministic(make_engine, run_engine):
    runs = [run_engine(engine_for(make_engine, True, num_gpu_blocks_override=9,
                                  max_num_batched_tokens=16), PROMPTS, PARAMS)
            for _ in range(2)]
    assert completions(runs[0]) == completions(runs[1])
    assert [r.chunks for r in runs[0].records] == [r.chunks for r in runs[1].records]


def test_the_next_step_is_scheduled_while_the_forward_runs(make_engine, run_engine,
                                                           monkeypatch, synchronous):
    """Each forward waits until the engine has scheduled the step after it: with the
    forward on the engine's own thread that would never happen (it gives up after 10 s)."""
    engine = engine_for(make_engine, True)
    execute, schedule = engine.runner.execute, engine.scheduler.schedule
    num_schedules, changed = 0, threading.Condition()
    launched = itertools.count(1)
    overlapped, threads = [], set()

    def counted_schedule():
        nonlocal num_schedules
        plan = schedule()
        with changed:
            num_schedules += 1
            changed.notify_all()
        return plan

    def waiting_execute(prepared):
        index = next(launched)
        threads.add(threading.current_thread())
        with changed:
            overlapped.append(changed.wait_for(lambda: num_schedules > index, timeout=10))
        return execute(prepared)

    monkeypatch.setattr(engine.scheduler, "schedule", counted_schedule)
    monkeypatch.setattr(engine.runner, "execute", waiting_execute)
    run = run_engine(engine, PROMPTS, PARAMS)

    assert completions(run) == synchronous
    assert len(overlapped) >= 30 and all(overlapped)
    assert threading.current_thread() not in threads and len(threads) == 1


def test_stops_end_exactly_and_the_next_rows_are_dropped(make_engine, run_engine):
    """A stop token is known only once sampled: the step after it, already scheduled,
    starts without that sequence. max_tokens is known ahead: no row is ever wasted."""
    probe = run_engine(engine_for(make_engine, False), PROMPTS[:3], GREEDY)
    stops = [o.outputs[0].token_ids[4] for o in probe.outputs]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             stop_token_ids=[stop]) for stop in stops]
    params += [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 9)]
    prompts = PROMPTS[:3] * 2
    sync, run = (run_engine(engine_for(make_engine, mode), prompts, params)
                 for mode in (False, True))

    assert completions(run) == completions(sync)
    for output, sp in zip(run.outputs, params):
        token_ids = output.outputs[0].token_ids
        if sp.stop_token_ids:
            assert output.outputs[0].finish_reason == "stop"
            assert token_ids[-1] == sp.stop_token_ids[0] not in token_ids[:-1]
        else:
            assert len(token_ids) == sp.max_tokens
        decodes = [chunk for r in run.records for chunk in r.chunks
                   if chunk[0] == output.request_id and chunk[2] == "decode"]
        assert len(decodes) == len(token_ids) - 1  # each decode gave one token
        last = max(i for i, r in enumerate(run.records) if output.request_id in r.finished)
        assert all(chunk[0] != output.request_id
                   for r in run.records[last + 1:] for chunk in r.chunks)


def test_an_abort_while_the_forward_runs_leaves_the_others_exact(make_engine, run_engine,
                                                                 synchronous):
    engine = engine_for(make_engine, True, num_gpu_blocks_override=9, max_num_batched_tokens=16)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(PROMPTS, PARAMS)]
    for _ in range(12):
        engine.step()
    assert engine.has_unfinished_requests()
    aborted = engine.abort_request(ids[2])  # its next step's forward is running now
    assert aborted.finished and {c.finish_reason for c in aborted.outputs} == {"abort"}
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step().outputs if o.finished)

    assert ids[2] not in finished
    assert engine.requests == {}
    for index, request_id in enumerate(ids):
        if index != 2:
            outputs = sorted(finished[request_id].outputs, key=lambda c: c.index)
            assert [c.token_ids for c in outputs] == synchronous[index]
    assert_nothing_held(engine)


@pytest.mark.parametrize("failing_call", [3, 20, 41])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_counts_its_tokens_as_not_computed(async_scheduling, failing_call,
                                                            make_engine, run_engine,
                                                            monkeypatch, synchronous):
    """The failure surfaces from step(); a caller that carries on gets exact outputs."""
    engine = engine_for(make_engine, async_scheduling, preemption_mode="swap",
                        num_gpu_blocks_override=9, swap_space=0.001,
                        max_num_batched_tokens=16)
    execute, calls = engine.runner.execute, itertools.count()

    def failing_once(prepared):
        if next(calls) == failing_call:
            raise RuntimeError("the device fell over")
        return execute(prepared)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(PROMPTS, PARAMS)]
    finished, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            result = engine.step()
        except RuntimeError:
            failures += 1
            continue
        finished.update((o.request_id, o) for o in result.outputs if o.finished)

    assert failures == 1
    assert [[c.token_ids for c in sorted(finished[i].outputs, key=lambda c: c.index)]
            for i in ids] == synchronous
    assert_nothing_held(engine)


def test_beam_search_runs_its_steps_without_overlap(make_engine):
    outputs = []
    for mode in (False, True):
        engine = engine_for(make_engine, mode)
        engine.add_request(PROMPTS[1], BeamSearchParams(3, 8))
        engine.add_request(PROMPTS[0], GREEDY)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step().outputs if o.finished]
        outputs.append(sorted((o.request_id, [c.token_ids for c in o.outputs]) for o in done))
        assert_nothing_held(engine)
    assert outputs[0] == outputs[1]


def test_the_served_engine_streams_the_synchronous_text(tiny_llama_path):
    texts = []
    for mode in (False, True):
        engine = AsyncEngine(EngineCore(EngineConfig(
            model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
            num_gpu_blocks_override=64, max_model_len=128, async_scheduling=mode))).start()

        async def consume():
            streams = [engine.submit(f"prompt number {i}", SamplingParams(
                max_tokens=6 + i, ignore_eos=True, seed=i, n=1 + i % 2)) for i in range(4)]

            async def text(stream):
                pieces = []
                async for output in stream:
                    pieces.append(output.deltas)
                return ["".join(p) for p in zip(*pieces)]

            return await asyncio.gather(*(text(stream) for stream in streams))

        try:
            texts.append(asyncio.run(consume()))
        finally:
            engine.shutdown()
    assert texts[0] == texts[1] and all(t for sample in texts[1] for t in sample)


def test_the_knob_is_checked_by_name():
    with pytest.raises(ValueError, match="async_scheduling='yes' must be True or False"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling=True with speculative_config"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram"})
