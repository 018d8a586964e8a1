"""The disk tier (--kv-offload-dir): time to first token of a request whose long prefix is in
the tier against the same request computed, a warm restart against a cold start, and the
tier's load rate against a sequential read of the same files. Prints JSON.

Per model (the default SmolLM2-135M-Instruct, and a Qwen3-1.7B-shaped random model saved
in bf16 from transformers' config class, bench/models.py's shape):
  computed        a fresh engine on an empty tier: the prefix is computed (the cold start)
  warm restart    the first engine closed (it saves its pool to the tier); a second engine
                  on the same directory, same model and knobs, serves the same prompt
  tier            in that second engine, the pool's prefix cache forgotten
                  (BlockPool.reset_cache), the same prompt again: loaded from the tier
  load rate       the tier's bytes over its I/O thread's reading time, against reading the
                  same files front to back in one pass (both from the disk: the files' pages
                  are dropped from the page cache with posix_fadvise first)
Each prompt is the prefix plus one token; TTFT is submit to first token (max_tokens=1).

    python bench/kv_tiers.py                           # both models, 4k-token prefix
    python bench/kv_tiers.py --models default --prefix-tokens 1024   # a quick check
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from served import cpu_name

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from models import SHAPES
from random_model import save_random_model

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
READ_CHUNK = 8 << 20


def ttft(engine: EngineCore, prompt: list[int]) -> float:
    started = time.perf_counter()
    request = engine.add_request(prompt, FIRST_TOKEN)
    while not request.finished:
        engine.step()
    return time.perf_counter() - started


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read_rate(files: list[Path]) -> float:
    """Bytes per second reading the files front to back, one after another."""
    drop_from_page_cache(files)
    buffer = bytearray(READ_CHUNK)
    total, started = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as file:
            while read := file.readinto(buffer):
                total += read
    return total / (time.perf_counter() - started)


def measure(model: str | None, knobs: dict, prefix_tokens: int) -> dict:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as folder:
        config = EngineConfig(model=model, kv_offload_dir=folder, kv_offload_gb=8.0,
                              max_model_len=prefix_tokens + 64, **knobs)
        cold = EngineCore(config)
        vocab = cold.runner.hf_config.vocab_size
        prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(prefix_tokens + 1)]
        computed = ttft(cold, prompt)
        started = time.perf_counter()
        cold.close()
        save_seconds = time.perf_counter() - started
        runner = cold.runner
        del cold

        files = sorted(Path(folder).glob("*/*.kvb"))
        drop_from_page_cache(files)
        warm = EngineCore(config, runner=runner)
        warm_restart = ttft(warm, prompt)
        loaded_restart = warm.kv_tier.stats.hits

        warm.kv_cache.pool.reset_cache()
        drop_from_page_cache(files)
        before = (warm.kv_tier.stats.bytes_loaded, warm.kv_tier.stats.load_seconds)
        from_tier = ttft(warm, prompt)
        stats = warm.kv_tier.stats
        load_bytes, load_seconds = stats.bytes_loaded - before[0], stats.load_seconds - before[1]
        warm.close()
        sequential = sequential_read_rate(files)
        load_rate = load_bytes / load_seconds if load_seconds else None
        return {
            "prefix_tokens": prefix_tokens, "block_size": config.block_size,
            "dtype": str(runner.dtype),
            "ttft_computed_s": round(computed, 3),
            "ttft_from_tier_s": round(from_tier, 3),
            "tier_speedup": round(computed / from_tier, 2),
            "ttft_warm_restart_s": round(warm_restart, 3),
            "warm_restart_speedup": round(computed / warm_restart, 2),
            "tokens_loaded_at_restart": loaded_restart,
            "tier_files": len(files), "tier_bytes": sum(p.stat().st_size for p in files),
            "save_at_close_s": round(save_seconds, 3),
            "tier_load_rate_MBps": round(load_rate / 1e6, 1) if load_rate else None,
            "sequential_read_MBps": round(sequential / 1e6, 1),
            "load_rate_vs_sequential": round(load_rate / sequential, 2) if load_rate else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["default", "qwen3-1.7b"],
                        choices=["default", "qwen3-1.7b"])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--qwen-layers", type=int, default=None,
                        help="fewer decoder layers of the Qwen3-1.7B shape (default: all 28)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--save-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the random model is saved")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
               "tier_dir": tempfile.gettempdir(), "models": {}}
    for name in args.models:
        if name == "default":
            results["models"][name] = measure(None, {}, args.prefix_tokens)
            print(json.dumps({name: results["models"][name]}), file=sys.stderr, flush=True)
            continue
        shape = SHAPES[name]()
        if args.qwen_layers:
            shape.num_hidden_layers = args.qwen_layers
        with tempfile.TemporaryDirectory(dir=args.save_dir) as model_folder:
            save_random_model(Path(model_folder), shape, torch.bfloat16)
            results["models"][name] = {
                "layers": shape.num_hidden_layers,
                **measure(model_folder, {"dtype": "bfloat16", "device_memory_gb": 8.0},
                          args.prefix_tokens)}
            print(json.dumps({name: results["models"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
