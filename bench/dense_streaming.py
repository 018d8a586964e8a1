"""The dense streaming linear (cpu_kernels.linear at up to DENSE_KERNEL_MAX_ROWS rows) over a
whole model's weights, read from DRAM as a decode step reads them: median ms and GFLOP/s
per row count.

Builds --layers layers of a Llama-shaped model's four linears (qkv, o, gate_up, down of
--shape HIDDEN,FFN,HEADS,KV_HEADS; the default is SmolLM2-135M's) with random weights in
--dtype, far more bytes than the caches hold, and times one pass over all of them per row
count, the row counts alternated round by round so that a shared machine's drifts hit each
alike. One row is bandwidth-bound; with more rows the dot products grow until compute
dominates, and how well the two overlap shows as ms per added row.

Usage:
  python bench/dense_streaming.py --rows 1,5,9,16,32
  python bench/dense_streaming.py --dtype float32 --shape 2048,8192,32,8 --layers 16
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
from served import cpu_name  # noqa: E402
from stream_vs_gemm import layer_shapes  # noqa: E402

from kvscope.kernels import cpu_kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,5,9,16,32")
    parser.add_argument("--shape", default="576,1536,9,3", help="HIDDEN,FFN,HEADS,KV_HEADS")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cpu_kernels.load()
    dtype = getattr(torch, args.dtype)
    shapes = layer_shapes(*(int(v) for v in args.shape.split(",")))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, into, generator=generator).to(dtype) * 0.02
               for _ in range(args.layers) for out, into in shapes]
    row_counts = [int(r) for r in args.rows.split(",")]
    inputs = {rows: {into: torch.randn(rows, into).to(dtype) for _, into in shapes}
              for rows in row_counts}
    if max(row_counts) > cpu_kernels.DENSE_KERNEL_MAX_ROWS:
        parser.error(f"--rows: at most {cpu_kernels.DENSE_KERNEL_MAX_ROWS} (more go to GEMM)")

    def one_pass(rows: int) -> float:
        started = time.perf_counter()
        for weight in weights:
            cpu_kernels.linear(inputs[rows][weight.shape[1]], weight)
        return time.perf_counter() - started

    for rows in row_counts:  # untimed: page faults and the thread pool's start
        one_pass(rows)
    seconds: dict[int, list[float]] = {rows: [] for rows in row_counts}
    for _ in range(args.rounds):
        for rows in row_counts:
            seconds[rows].append(one_pass(rows))
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    parameters = sum(w.numel() for w in weights)
    first = statistics.median(seconds[row_counts[0]])
    results = {}
    for rows in row_counts:
        median = statistics.median(seconds[rows])
        results[rows] = {"median_ms": round(median * 1e3, 2),
                         "gflop_s": round(2 * rows * parameters / median / 1e9, 1),
                         "weight_gb_s": round(weight_bytes / median / 1e9, 1),
                         "vs_first_row_count": round(median / first, 3)}
    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
                      "dtype": args.dtype, "weight_mb": round(weight_bytes / 1e6, 1),
                      "rows": results}, indent=1))


if __name__ == "__main__":
    main()
