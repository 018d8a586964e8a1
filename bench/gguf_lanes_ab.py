"""A GGUF file's single stream with its layers repacked into lanes (kernels/gguf_lanes.py,
what a load does where the kernels choose it) against the file's own blocks, in one process:
two engines on the same file, their greedy generations alternating, so both see the same
machine (a shared host's memory and L3 move single-stream rates by tens of percent between
minutes). Prints JSON: tok/s per round and the medians, and each engine's weight bytes per
type.

Usage:
  python bench/gguf_lanes_ab.py --model model.Q4_K_M.gguf [--tokens 96] [--rounds 5]
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

from served import cpu_name  # noqa: E402

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.worker import model_runner  # noqa: E402

PROMPT = "The history of the paged attention kernel"


def engine(path: str, repack: bool) -> LLM:
    """An engine on `path`; without `repack`, its GGUF layers keep the file's blocks."""
    chosen = model_runner.repack_gguf
    if not repack:
        model_runner.repack_gguf = lambda *args: None
    try:
        return LLM(path, quantization="gguf", dtype="bfloat16")
    finally:
        model_runner.repack_gguf = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engines = {"lanes": engine(args.model, True), "blocks": engine(args.model, False)}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    rates = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.generate([PROMPT], params)  # its weights back in the caches it can have
            started = time.perf_counter()
            llm.generate([PROMPT], params)
            rates[name].append(round(args.tokens / (time.perf_counter() - started), 1))
    print(json.dumps({
        "cpu": cpu_name(), "model": args.model, "tokens": args.tokens,
        "tok_s": rates, "median_tok_s": {name: statistics.median(r) for name, r in rates.items()},
        "lanes_vs_blocks": round(statistics.median(rates["lanes"]) / statistics.median(rates["blocks"]), 3),
        "weight_bytes_by_type": {name: llm.engine.memory_plan.weight_bytes_by_type
                                 for name, llm in engines.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
