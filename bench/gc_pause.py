"""How long one full garbage collection takes once a large pool is all cached.

A full (generation-2) collection walks every object the collector tracks and holds the
GIL while it does, pausing the engine's step on whichever thread triggers it. The engine
freezes its start-up heap (kvscope.engine.orchestrator.heap), so what a collection walks is what came later:
this builds a pool of --blocks blocks, freezes it as AsyncEngine.start does, caches every
block as a long session would (block_size 1, one chained hash per block), then times one
full collection.

With --live-seconds S it also runs the engine itself for S seconds on a pool of --blocks
blocks (block_size 1, a tiny random model), 16 requests kept in flight and the dashboard's
feed refreshed every second (bench/dashboard_scale.py's load and refresh handler): every
full collection in that time, the longest on the engine thread (wall and CPU), and what a
full collection walks at the end: the tracked objects, generation 2 of them, by type.

Usage:
  flock /work/bench.lock .venv/bin/python bench/gc_pause.py --blocks 1000000
  flock /work/bench.lock .venv/bin/python bench/gc_pause.py --blocks 1000000 --live-seconds 60
"""

import argparse
import collections
import gc
import json
import tempfile
import time
from pathlib import Path

from kvscope.engine.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvscope.engine.core.request import Request, Sequence  # noqa: E402
from kvscope.engine.orchestrator import heap  # noqa: E402
from kvscope.engine.sampling_params import SamplingParams  # noqa: E402


def cache_every_block(manager: KVCacheManager) -> None:
    """One sequence over the whole pool (block size 1): each block cached, chained."""
    pool = manager.pool
    num_blocks = pool.num_blocks
    token_ids = list(range(num_blocks + 1))
    request = Request("gc", None, token_ids, SamplingParams(max_tokens=1))
    seq = Sequence("gc", request, 0, token_ids, len(token_ids))
    blocks = pool.allocate(num_blocks)
    seq.block_table = [block.block_id for block in blocks]
    seq.num_computed_tokens = num_blocks
    for block, block_hash in zip(blocks, manager._block_hashes(seq, num_blocks)):
        pool.cache(block, block_hash, group=0)
    pool.release(reversed(blocks))


def live_run(num_blocks: int, seconds: float) -> dict:
    """The engine serving with the dashboard's feed refreshed each second, for `seconds`."""
    import dashboard_scale as scale  # the same load, engine and refresh as that bench

    clock = scale.GcClock()
    with tempfile.TemporaryDirectory() as folder:
        engine = scale.AsyncEngine.from_config(scale.EngineConfig(
            model=str(scale.save_tiny_model(Path(folder))), dtype="float32", device="cpu",
            block_size=1, num_gpu_blocks_override=num_blocks, max_model_len=scale.MAX_MODEL_LEN,
            max_num_batched_tokens=512, device_memory_gb=4.0)).start()
        load = scale.Load(engine, engine.tokenizer.vocab_size)
        try:
            tab, shown = scale.refresher(scale.LiveFeed(engine)), None
            load.start()
            clock.reset()  # from here on: start-up is frozen out of collections
            steps_before, started = engine.counters().num_steps, time.monotonic()
            while time.monotonic() - started < seconds:
                time.sleep(1.0)
                *_, shown = scale.refresh(tab, shown)
            steps = engine.counters().num_steps - steps_before
            walked = gc.get_objects(generation=2)
            census = collections.Counter(type(o).__qualname__ for o in walked).most_common(8)
            report = {"seconds": seconds, "steps": steps, **clock.report(),
                      "generation_2_by_type": dict(census)}
            del walked
        finally:
            load.stopping = True
            load.stop()
            engine.shutdown()
        gc.callbacks.remove(clock._note)
    full = [c for c in clock.collections if c[0] == 2]
    report["full_collections_by_thread"] = dict(collections.Counter(c[3] for c in full))
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--live-seconds", type=float, default=0.0,
                        help="also run the engine and the dashboard feed this long")
    args = parser.parse_args(argv)
    if args.live_seconds:
        print(json.dumps({"num_blocks": args.blocks,
                          "live": live_run(args.blocks, args.live_seconds)}), flush=True)
    manager = KVCacheManager(args.blocks, block_size=1)
    gc.collect()
    heap.freeze_long_lived()
    cache_every_block(manager)
    gc.collect()  # untracks what can be untracked, as the engine's running collections do
    gc.collect()
    wall, cpu = time.perf_counter(), time.thread_time()
    gc.collect()
    print(json.dumps({
        "num_blocks": args.blocks,
        "num_cached_blocks": len(manager.pool.cached_blocks),
        "full_collection_ms": round(1e3 * (time.perf_counter() - wall), 2),
        "full_collection_cpu_ms": round(1e3 * (time.thread_time() - cpu), 2),
        "objects_a_full_collection_walks": len(gc.get_objects()),
    }))


if __name__ == "__main__":
    main()
