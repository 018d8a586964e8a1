"""One batch's paged attention alone, per KV cache dtype: time, K/V bytes per second and,
for prefills, GFLOP/s.

--seqs sequences, each --query-len query tokens (1: a decode) over --context cached keys
and their own, causally, through every layer's cache: --layers caches of random K/V, so the
batch's K/V reads come from memory, as a decode step's do, and on huge pages, as the engine's
pool is (engine/worker/huge_pages.py). The model shape is given by --heads / --kv-heads /
--head-dim, and the block table holds random blocks (a long-running pool's is scattered).
Per KV dtype it prints the best of --rounds passes over the layers: milliseconds, the K/V
bytes read over that time (codes and scales for a quantized cache), and the scores' and
weighted values' multiply-adds as GFLOP/s (what a prefill is bound by), and the K/V bytes per
second as a share of the bandwidth probe (engine/worker/memory_bandwidth.py), read before
and after the dtypes (the faster kept). The query is bf16 (fp32 for an fp32 cache), as the
engine's is. Compare dtypes within one run. Issue 67's target: a batch-64 decode over
300-token contexts (--seqs 64 --context 300) at >= 0.8 of the probe for every dtype.

Usage:
  python bench/attention.py                                # SmolLM2-135M's heads, 32 x 2,000
  python bench/attention.py --dtypes bf16,int8 --seqs 64 --context 300
  python bench/attention.py --dtypes bf16 --seqs 1 --context 0 --query-len 2000  # a prefill
  python bench/attention.py --sinks                         # gpt-oss's attention sinks on
"""

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402

from kvscope.engine.worker import huge_pages  # noqa: E402
from kvscope.engine.worker.memory_bandwidth import read_bandwidth  # noqa: E402
from kvscope.kernels import cpu_kernels, kv_quant  # noqa: E402

# The model-dtype caches by name, and the quantized ones by their kv_cache_dtype names.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32,
          **{name: codes for name, codes in kv_quant.CODE_DTYPES.items() if codes is not None}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,int8,fp8,fp32")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sinks", action="store_true",
                        help="a sink logit per query head (gpt-oss) in every softmax")
    args = parser.parse_args(argv)
    if args.query_len < 1:
        parser.error(f"--query-len={args.query_len}: a sequence has at least 1 query token")
    return args


def on_huge_pages(cache: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` where the engine would keep it: on 4 KiB pages a batch's scattered
    blocks miss the TLB, and a 64 x 300 decode batch of Qwen3-1.7B's heads read slower
    (docs/performance-history.md, "A decode's attention by key groups over every KV head")."""
    pool = huge_pages.empty(tuple(cache.shape), cache.dtype)
    pool.copy_(cache)
    return pool


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.load()
    generator = torch.Generator().manual_seed(args.seed)
    seq_len = args.context + args.query_len
    blocks_per_seq = -(-seq_len // args.block_size)
    num_blocks = args.seqs * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=generator, dtype=torch.int32).view(
        args.seqs, blocks_per_seq)
    seq_lens = torch.full((args.seqs,), seq_len, dtype=torch.int32)
    starts = torch.arange(args.seqs + 1, dtype=torch.int32) * args.query_len
    query = torch.randn(args.seqs * args.query_len, args.heads, args.head_dim, generator=generator)
    sinks = torch.randn(args.heads, generator=generator) if args.sinks else None
    # Query token t sees context + t + 1 keys: a multiply-add per head dimension for its
    # score and one for its weighted value, per key.
    seen_keys = args.query_len * args.context + args.query_len * (args.query_len + 1) // 2
    flops = 4 * args.layers * args.seqs * args.heads * args.head_dim * seen_keys
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    results = {}
    probes = [read_bandwidth(huge=True)]
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        layers = [tuple(on_huge_pages(kv_quant.encode(torch.randn(shape, generator=generator),
                                                      dtype))
                        for _ in range(2)) for _ in range(args.layers)]
        q = query.to(torch.float32 if dtype == torch.float32 else torch.bfloat16)
        best = float("inf")
        for _ in range(args.rounds):
            started = time.perf_counter()
            for key_cache, value_cache in layers:
                cpu_kernels.paged_attention(q, key_cache, value_cache, tables, seq_lens, starts,
                                            args.head_dim ** -0.5, sinks=sinks)
            best = min(best, time.perf_counter() - started)
        row_bytes = kv_quant.row_width(args.head_dim, dtype) * dtype.itemsize
        read = 2 * args.layers * args.seqs * seq_len * args.kv_heads * row_bytes
        results[name] = {"ms": round(best * 1e3, 1), "kv_gb_s": round(read / best / 1e9, 2),
                         "gflop_s": round(flops / best / 1e9, 1), "kv_bytes_per_s": read / best}
        del layers
    probes.append(read_bandwidth(huge=True))
    for result in results.values():
        result["kv_share_of_probe"] = round(result.pop("kv_bytes_per_s") / max(probes), 3)
    print(json.dumps({"seqs": args.seqs, "context": args.context, "query_len": args.query_len,
                      "heads": args.heads,
                      "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "block_size": args.block_size, "layers": args.layers,
                      "sinks": args.sinks,
                      "probe_gb_s": [round(probe / 1e9, 2) for probe in probes],
                      "torch_threads": torch.get_num_threads(), "kv_cache_dtypes": results},
                     indent=1))


if __name__ == "__main__":
    main()
