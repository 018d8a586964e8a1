"""How long one full garbage collection takes once a large pool is all cached.

A full (generation-2) collection walks every object the collector tracks and holds the
GIL while it does, pausing the engine's step on whichever thread triggers it. The engine
freezes its start-up heap (engine.heap), so what a collection walks is what came later:
this builds a pool of --blocks blocks, freezes it as AsyncEngine.start does, caches every
block as a long session would (block_size 1, one chained hash per block), drains the
step's touched-block log as take_pool_delta does, then times one full collection.

Usage:
  flock /work/bench.lock .venv/bin/python bench/gc_pause.py --blocks 1000000
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import heap  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request, Sequence  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


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
        pool.cache(block, block_hash)
    pool.release(reversed(blocks))
    pool.events.blocks.clear()  # the engine drains it every step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args(argv)
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
