"""Tests for kvscope.engine.orchestrator.async_engine: streams, abort, failures, feeds,
snapshots, reconfigure."""

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
from conftest import wait_until

from kvscope.engine.config import EngineConfig
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.orchestrator.streams import EngineClosed, RequestFailed
from kvscope.engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def short(max_tokens: int = 6, **knobs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **knobs)


@pytest.fixture(scope="module")
def core(tiny_llama_path) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=128, max_model_len=256, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def engine(core) -> AsyncEngine:
    engine = AsyncEngine(core).start()
    yield engine
    engine.shutdown()



def assert_pool_idle(engine: AsyncEngine) -> None:
    snapshot = engine.snapshot()
    assert snapshot.count("used") + snapshot.count("shared") == 0
    assert not snapshot.sequences


def test_sync_stream_yields_deltas_that_add_up_to_the_text(engine) -> None:
    outputs = list(engine.submit("hello world", short(8)))
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    final = outputs[-1].outputs[0]
    assert len(final.token_ids) == 8 and final.finish_reason == "length"
    assert "".join(o.deltas[0] for o in outputs) == final.text != ""


def test_async_streams_run_concurrently_and_match_sync_results(engine) -> None:
    params = short(6, seed=7, n=2)
    expected = list(engine.submit("same prompt", params))[-1]

    async def consume():
        streams = [engine.submit("same prompt", params) for _ in range(4)]

        async def texts(stream):
            pieces = [[], []]
            async for output in stream:
                for index, delta in enumerate(output.deltas):
                    pieces[index].append(delta)
            return ["".join(p) for p in pieces]

        return await asyncio.gather(*(texts(stream) for stream in streams))

    for texts in asyncio.run(consume()):
        assert texts == [sample.text for sample in expected.outputs]


def test_bad_input_is_refused_and_the_engine_keeps_serving(engine) -> None:
    stream = engine.submit("x" * 300, short())
    with pytest.raises(ValueError, match=r"prompt: 300 tokens.*max_model_len=256"):
        stream.wait_accepted(timeout=10)
    with pytest.raises(ValueError):
        list(stream)
    with pytest.raises(ValueError, match="messages"):
        engine.submit_chat([], short())
    assert list(engine.submit("still fine", short(3)))[-1].finished


def test_abort_ends_the_stream_and_frees_blocks(engine) -> None:
    stream = engine.submit("a long one", LONG)
    iterator = iter(stream)
    next(iterator)
    stream.abort()
    rest = list(iterator)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 200
    assert_pool_idle(engine)


def test_failed_step_fails_its_requests_and_the_engine_recovers(engine, core,
                                                                monkeypatch) -> None:
    execute = core.runner.execute
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device fault")
        return execute(*args, **kwargs)

    before = engine.counters().step_failures
    monkeypatch.setattr(core.runner, "execute", fail_once)
    streams = [engine.submit(f"victim {i}", LONG) for i in range(3)]
    for stream in streams:
        with pytest.raises(RequestFailed, match="injected device fault"):
            list(stream)
    assert engine.counters().step_failures == before + 1
    assert engine.counters().requests_finished.get("error", 0) >= 3
    assert list(engine.submit("after the fault", short(4)))[-1].outputs[0].finish_reason \
        == "length"
    assert_pool_idle(engine)


def engine_thread_cpu_ticks(engine: AsyncEngine) -> int:
    """User + system clock ticks the engine thread has used (Linux /proc)."""
    stat = Path(f"/proc/self/task/{engine._thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def test_the_dashboard_interface_is_the_async_engine(engine) -> None:
    assert isinstance(engine, EngineView)
    # One engine answers the replica questions trivially: one replica, nothing routed.
    assert engine.num_replicas == len(engine.replica_statuses()) == 1
    assert engine.routing is None and engine.routing_load_weight is None
    assert not engine.recent_decisions and engine.router_view() is None
    decisions = engine.subscribe_decisions()
    assert not decisions.closed and decisions.drain() == []
    with pytest.raises(ValueError, match="routing"):
        engine.set_routing("round-robin")


def test_prefix_cache_counters_add_up_the_step_records(engine) -> None:
    steps = engine.subscribe_steps()
    before = engine.counters()
    prompt = "the same prompt, long enough to fill whole blocks"
    num_tokens = len(engine.tokenizer(prompt).input_ids)
    for _ in range(2):  # the second run of the prompt finds its blocks cached
        list(engine.submit(prompt, short(3)))
    records, after = steps.drain(), engine.counters()
    steps.close()
    hits = sum(r.prefix_cache_hits for r in records)
    assert hits == (num_tokens - 1) // 8 * 8  # its full 8-token blocks, one token short
    assert after.prefix_cache_hits - before.prefix_cache_hits == hits
    assert (after.prefix_cache_queries - before.prefix_cache_queries
            == sum(r.prefix_cache_queries for r in records) == 2 * num_tokens)


def test_idle_engine_sleeps(engine) -> None:
    """An idle engine thread waits on its condition: it takes no steps and no CPU, however
    busy the machine is (CPU ticks of that thread, not a wall-clock limit)."""
    list(engine.submit("wake up", short(2)))
    steps, ticks = engine.counters().num_steps, engine_thread_cpu_ticks(engine)
    time.sleep(0.5)  # the window idleness is observed over: the behaviour under test
    assert engine.counters().num_steps == steps
    assert engine_thread_cpu_ticks(engine) - ticks <= 1  # one tick of rounding at most


def test_the_engine_thread_and_its_openmp_workers_carry_the_engine_name(engine) -> None:
    list(engine.submit("name the threads", short(3)))
    tasks = Path("/proc/self/task")
    named = {task.name for task in tasks.iterdir()
             if (task / "comm").read_text().strip() == "kvscope-engine"}
    assert str(engine._thread.native_id) in named
    assert (tasks / str(threading.get_native_id()) / "comm").read_text().strip() \
        != "kvscope-engine"


def test_step_subscribers_get_records_and_a_slow_one_loses_the_oldest(engine) -> None:
    reader, laggard = engine.subscribe_steps(), engine.subscribe_steps(maxsize=3)
    list(engine.submit("feed me", short(10)))
    records = reader.drain()
    assert len(records) >= 10
    assert [r.step for r in records] == sorted(r.step for r in records)
    kept = laggard.drain()
    assert [r.step for r in kept] == [r.step for r in records[-3:]]
    assert laggard.num_dropped == len(records) - 3
    reader.close()
    laggard.close()


def test_request_feed_reports_finished_requests(engine) -> None:
    feed = engine.subscribe_requests()
    stream = engine.submit("record me", short(5), source="loadgen")
    list(stream)
    (record,) = feed.drain()
    assert record.source == "loadgen" and record.finish_reason == "length"
    assert record.output.request_id == stream.request_id
    assert len(record.inter_token_latencies) == 4  # between 5 tokens
    feed.close()


def test_snapshot_during_traffic_accounts_for_every_block(engine) -> None:
    streams = [engine.submit(f"busy {i}", short(30)) for i in range(4)]
    for stream in streams:  # each has its first token: all four hold blocks now
        next(iter(stream))
    snapshot = engine.snapshot()
    assert len(snapshot.blocks) == snapshot.num_blocks == 128
    # A block is in use exactly when a live sequence's block table holds it, and its
    # reference count is the number of those tables.
    held = {block_id for seq in snapshot.sequences for block_id in seq.block_table}
    in_use = {b.block_id for b in snapshot.blocks if b.state in ("used", "shared")}
    assert held == in_use and len(snapshot.sequences) == 4
    assert all(b.ref_count == len(b.owners) for b in snapshot.blocks)
    assert all(b.block_hash is not None for b in snapshot.blocks if b.state == "cached")
    for stream in streams:
        list(stream)
    assert_pool_idle(engine)


def test_invalid_reconfigure_changes_nothing(engine) -> None:
    config, plan = engine.config, engine.memory_plan
    with pytest.raises(ValueError, match="block_size=3"):
        engine.reconfigure(block_size=3)
    with pytest.raises(ValueError, match="unknown engine knob"):
        engine.reconfigure(blocksize=16)
    with pytest.raises(ValueError, match="model"):
        engine.reconfigure(model="elsewhere")
    # Passes the config's checks, fails the memory plan (a pool smaller than one sequence).
    with pytest.raises(ValueError, match="max_model_len"):
        engine.reconfigure(num_gpu_blocks_override=2)
    assert engine.config is config and engine.memory_plan is plan
    assert list(engine.submit("unchanged", short(3)))[-1].finished


def test_reconfigure_waits_for_running_requests_and_holds_new_ones(engine) -> None:
    running = engine.submit("in flight", short(40))
    running.wait_accepted(timeout=10)
    plan = {}
    worker = threading.Thread(target=lambda: plan.update(new=engine.reconfigure(block_size=16)))
    worker.start()
    wait_until(lambda: engine.is_reconfiguring)
    held = engine.submit("arrives meanwhile", short(4))
    outputs = list(running)
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 40
    worker.join(timeout=30)
    assert plan["new"].block_size == 16 and engine.config.block_size == 16
    assert list(held)[-1].finished
    assert engine.snapshot().block_size == 16
    assert_pool_idle(engine)

    # abort_running: in-flight requests end as aborted instead of finishing.
    victim = engine.submit("cut short", LONG)
    victim.wait_accepted(timeout=10)
    engine.reconfigure(block_size=8, abort_running=True)
    assert list(victim)[-1].outputs[0].finish_reason == "abort"
    assert engine.config.block_size == 8
    assert_pool_idle(engine)


def test_shutdown_aborts_in_flight_and_refuses_new_requests(engine) -> None:
    """Runs last: it stops the module's engine."""
    stream = engine.submit("never finishes", LONG)
    stream.wait_accepted(timeout=10)
    engine.shutdown(abort_running=True, timeout=10)
    assert not engine.is_running
    assert list(stream)[-1].outputs[0].finish_reason == "abort"
    with pytest.raises(EngineClosed):
        engine.submit("too late", short())
    with pytest.raises(EngineClosed):
        engine.snapshot()


def test_reconfigure_to_a_longer_max_model_len_serves_the_longer_prompts(tiny_llama_path):
    """The weights (and the rotary table) outlive a reconfigure, so they must cover every
    position the model supports, not just the first max_model_len."""
    engine = AsyncEngine(EngineCore(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=128, max_model_len=32, max_num_batched_tokens=256))).start()
    try:
        prompt = "hello world " * 8  # ~100 tokens
        with pytest.raises(ValueError, match="max_model_len=32"):
            list(engine.submit(prompt, short(4)))
        engine.reconfigure(max_model_len=256)
        outputs = list(engine.submit(prompt, short(4)))
        assert len(outputs[-1].outputs[0].token_ids) == 4
        assert_pool_idle(engine)
    finally:
        engine.shutdown()


def test_an_engine_never_started_shuts_down_at_once(core) -> None:
    idle = AsyncEngine(core)
    assert not idle.is_running
    idle.shutdown(timeout=1)
    idle._thread.join(5)
    assert not idle._thread.is_alive()


def test_the_pool_is_frozen_out_of_collections_and_a_replaced_one_is_reclaimed(
        tiny_llama_path) -> None:
    """A full garbage collection walks every tracked object: the started engine's blocks
    are frozen out of it (kvscope.engine.orchestrator.heap), yet a pool dropped by reconfigure is still
    reclaimed (its free queue links its blocks in cycles) and shutdown thaws the rest."""
    engine = AsyncEngine(EngineCore(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=64, max_num_batched_tokens=64)))
    try:
        engine.start()
        frozen = gc.get_freeze_count()
        assert frozen >= 64  # at least the blocks
        old_pool = weakref.ref(engine._core.kv_cache.pool)
        block = old_pool().blocks[0]
        assert not any(tracked is block for tracked in gc.get_objects())  # frozen
        del block
        engine.reconfigure(num_gpu_blocks_override=48)
        assert old_pool() is None
        assert engine.snapshot().num_blocks == 48
        assert gc.get_freeze_count() > 0
        assert len(list(engine.submit("still serving", short(3)))[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0
