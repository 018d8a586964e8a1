"""Dense bf16/fp32 linears over a whole model's weights, read from DRAM as a decode step reads
them: median ms and GFLOP/s per row count and weight form.

Builds --layers layers of a Llama-shaped model's four linears (qkv, o, gate_up, down of
--shape HIDDEN,FFN,HEADS,KV_HEADS; the default is SmolLM2-135M's) with random weights in
--dtype, far more bytes than the caches hold, and times one pass over all of them per row
count and form, the row counts and forms alternated round by round so that a shared
machine's drifts hit each alike. One row is bandwidth-bound; with more rows the dot products
grow until compute dominates, and how well the two overlap shows as ms per added row.

--forms (cpu_kernels.linear routes each as the engine does):
  plain      the plain weight: the streaming kernel up to DENSE_KERNEL_MAX_ROWS rows, GEMM past
  prepacked  the weight as prepack_weight keeps it (bf16 only): the blocked kernel over
             kvscope's own tiles, or over oneDNN's AMX tiles through AMX itself up to
             AMX_TILE_KERNEL_MAX_ROWS rows and oneDNN's GEMM past
  onednn     oneDNN's GEMM over its prepacked AMX tiles at every row count (where it lays
             them out: CPUs with AMX)

Usage:
  python bench/dense_streaming.py --rows 1,5,9,16,32
  python bench/dense_streaming.py --dtype float32 --shape 2048,8192,32,8 --layers 16
  python bench/dense_streaming.py --shape 2048,6144,16,8 --layers 28 --rows 1,8,16,32,64,128 \
      --forms plain,prepacked,onednn --rounds 3        # Qwen3-1.7B's linears on AMX
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
    parser.add_argument("--forms", default="plain", help="comma-separated: plain,prepacked,onednn")
    args = parser.parse_args()
    cpu_kernels.load()
    dtype = getattr(torch, args.dtype)
    shapes = layer_shapes(*(int(v) for v in args.shape.split(",")))
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(out, into, generator=generator).to(dtype) * 0.02
             for _ in range(args.layers) for out, into in shapes]
    weights = {"plain": plain}
    form_names = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(form_names) - {"plain", "prepacked", "onednn"})
    if unknown:
        parser.error(f"--forms: unknown {unknown}; choose from plain, prepacked, onednn")
    if {"prepacked", "onednn"} & set(form_names):
        prepacked = [cpu_kernels.prepack_weight(w) for w in plain]
        if any(p is None for p in prepacked):
            parser.error("--forms prepacked/onednn: this CPU's kernels keep no tiles of these "
                         "weights (they need bf16 weights and AVX512-BF16)")
        weights["prepacked"] = prepacked
        if "onednn" in form_names:
            if prepacked[0].onednn is None:
                parser.error("--forms onednn: oneDNN lays no AMX tiles out on this CPU")
            weights["onednn"] = prepacked
    row_counts = [int(r) for r in args.rows.split(",")]
    inputs = {rows: {into: torch.randn(rows, into).to(dtype) for _, into in shapes}
              for rows in row_counts}

    def one_pass(form: str, rows: int) -> float:
        started = time.perf_counter()
        for weight in weights[form]:
            x = inputs[rows][weight.shape[1] if form == "plain" else weight.in_features]
            if form == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, weight.onednn, None, "none", [], "")
            else:
                cpu_kernels.linear(x, weight)
        return time.perf_counter() - started

    runs = [(form, rows) for rows in row_counts for form in form_names]
    for form, rows in runs:  # untimed: page faults and the thread pool's start
        one_pass(form, rows)
    seconds: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for run in runs:
            seconds[run].append(one_pass(*run))
    weight_bytes = sum(w.numel() * w.element_size() for w in plain)
    parameters = sum(w.numel() for w in plain)
    first = statistics.median(seconds[runs[0]])
    results = {form: {} for form in form_names}
    for form, rows in runs:
        median = statistics.median(seconds[form, rows])
        results[form][rows] = {"median_ms": round(median * 1e3, 2),
                               "gflop_s": round(2 * rows * parameters / median / 1e9, 1),
                               "weight_gb_s": round(weight_bytes / median / 1e9, 1),
                               "vs_first": round(median / first, 3)}
    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
                      "dtype": args.dtype, "weight_mb": round(weight_bytes / 1e6, 1),
                      "vs_first": f"median over the first run's ({runs[0][0]}, {runs[0][1]} rows)",
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
