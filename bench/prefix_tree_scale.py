"""The prefix tree (ui.figures.prefix_tree, a radix tree) at GPU-scale pools: the time to
build the figure from a pool mirror, per pool size, for the pool the load generator's
heavy preset leaves at block_size 1 (made up here at any size; tests/test_radix_tree.py
draws the same pools).

Reported per size (JSON on stdout): the figure's time (median and max of --repeats, the
reader's thread; numpy links and chains every block, Python touches the nodes drawn),
the nodes drawn and the chains in the tree, and the figure's JSON bytes.

Usage:
  flock /work/bench.lock .venv/bin/python bench/prefix_tree_scale.py --sizes 70000
"""

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolSlice
from kvscope.ui.figures import prefix_tree

WORDS = ("the", "paged", "attention", "design", "stores", "key", "and", "value", "cache",
         "of", "every", "sequence", "in", "fixed", "size", "blocks")


def decode_words(token_ids: tuple[int, ...]) -> str:
    return " ".join(WORDS[token % len(WORDS)] for token in token_ids)


def heavy_preset_mirror(num_blocks: int, running: int = 8, seed: int = 0) -> PoolMirror:
    """Requests as the heavy preset sends them ("Pool pushed into preemption"), one token
    a block: half start with a system prompt cut at a random length (one trunk, a branch
    where each leaves it), half are prose of their own; each adds its output. The last
    `running` requests still hold their blocks (ref counts), the rest are cached."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, 1024).tolist()
    tokens_of, parent_of, owners = [], [], []  # per block
    trunk: list[int] = []  # block ids of the system prompt's prefix stored so far
    request = 0
    while len(tokens_of) < num_blocks:
        length = int(rng.integers(256, 1025))
        prompt, shared = (system[:length], True) if rng.random() < 0.5 else (
            rng.integers(0, 1000, length).tolist(), False)
        tokens = prompt + rng.integers(0, 1000, int(rng.integers(16, 257))).tolist()
        parent = -1
        for position, token in enumerate(tokens):
            if shared and position < len(prompt) and position < len(trunk):
                parent = trunk[position]  # the system prompt's block, already stored
                owners[parent].append(request)
                continue
            if len(tokens_of) == num_blocks:
                break
            block = len(tokens_of)
            tokens_of.append(token)
            parent_of.append(parent)
            owners.append([request])
            if shared and position == len(trunk) and position < len(prompt):
                trunk.append(block)
            parent = block
        request += 1
    refs = [sum(owner >= request - running for owner in held) for held in owners]
    values = [block.to_bytes(16, "little") for block in range(num_blocks)]
    hashes = tuple((block, (values[block], values[parent] if parent >= 0 else None,
                            (tokens_of[block],)))
                   for block, parent in enumerate(parent_of))
    counters = PoolCounters(0, 0.0, num_blocks, 1, 0, 0, 0, 0, 0, 0, {"max_model_len": 2048})
    mirror = PoolMirror()
    mirror.apply(PoolBase(0, 0, counters, ()))
    mirror.apply(PoolSlice(0, 0, tuple(refs), hashes))
    return mirror


def measure(num_blocks: int, repeats: int) -> dict:
    mirror = heavy_preset_mirror(num_blocks)
    # The mirror's million hash tuples out of the collector's walks, as a long-running
    # reader's are after start-up (engine.orchestrator.heap): a collection that happens
    # to start inside the figure would time the collector, not the figure
    # (bench/dashboard_scale.py reports collections).
    gc.collect()
    gc.freeze()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        figure = prefix_tree(mirror, decode_words)
        seconds.append(time.perf_counter() - start)
    gc.unfreeze()
    icicle = figure["data"][0]
    return {"num_blocks": num_blocks, "figure_ms_median": round(1e3 * statistics.median(
        seconds), 1), "figure_ms_max": round(1e3 * max(seconds), 1),
            "nodes_drawn": len(icicle["ids"]) - 1,
            "title": figure["layout"]["title"]["text"].split("<br>")[0],
            "figure_bytes": len(json.dumps(figure))}


def main(argv=None) -> None:
    from dashboard_scale import cpu_name  # here: it loads Gradio, the tests need neither

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3_000, 70_000, 300_000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    results = [measure(num_blocks, args.repeats) for num_blocks in args.sizes]
    print(json.dumps({"machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
                      "block_size": 1, "results": results}, indent=1))


if __name__ == "__main__":
    main()
