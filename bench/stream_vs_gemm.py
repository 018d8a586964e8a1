"""Where the packed kernels should stop streaming: bf16 rows through the int8-rounding
kernels (tiled, the weights read once) against de-quantizing the weight for a GEMM.

For each form (int4, int8 and each GGUF type's lanes) it builds a Llama layer's four
linears (qkv, o, gate_up, down of --shape HIDDEN,FFN,HEADS,KV_HEADS) with random weights and
times, per row count, the layers' `stream` (what `kernel_max_rows` sends there) and
`ops.linear` over `dequantize` (what it sends past it: oneDNN's bf16 GEMM, or the widened
fp32 GEMM on a CPU without bf16 dot products). Prints JSON: per form and row count the
median ms of each route over the four layers, the GOP/s that implies and gemm/stream (above
1: streaming wins), next to the CPU's flags and the engine's kernel_max_rows.

Usage:
  flock /work/bench.lock python bench/stream_vs_gemm.py --rows 32,64,256,2048
  python bench/stream_vs_gemm.py --forms int4,Q4_K,Q6_K --shape 2048,8192,16,8
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import numpy as np  # noqa: E402
import torch  # noqa: E402
from quantized_linear import forms, gguf_forms  # noqa: E402
from served import cpu_name  # noqa: E402

from kvscope.engine.worker.models.quantized import kernel_max_rows  # noqa: E402
from kvscope.kernels import cpu_kernels  # noqa: E402


def layer_shapes(hidden: int, ffn: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    head_dim = hidden // heads
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, hidden),
            (2 * ffn, hidden), (hidden, ffn)]


def build(form: str, shapes: list[tuple[int, int]], rng: np.random.Generator) -> list:
    if form in ("int4", "int8"):
        return [forms(out, into, 32, False, torch.bfloat16)[form][0] for out, into in shapes]
    return [gguf_forms(out, into, [form], torch.bfloat16, rng)[f"gguf_{form}_lanes"][0]
            for out, into in shapes]


def median_seconds(call, repeats: int) -> float:
    call()  # warm: the first call pays page faults and the thread pool's start
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forms", default="int4,int8,Q4_K,Q5_K,Q6_K,Q8_0")
    parser.add_argument("--rows", default="32,64,256,2048")
    parser.add_argument("--shape", default="1024,3072,16,8", help="HIDDEN,FFN,HEADS,KV_HEADS")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ops = cpu_kernels.kernel_ops()
    packed = ops.packed
    if not packed.rounds_activations_to_int8:
        sys.exit("stream_vs_gemm: this build's kernels compute bf16 exactly (no AVX512-VNNI): "
                 "they stream at most 8 rows, and there is nothing to compare")
    shapes = layer_shapes(*(int(v) for v in args.shape.split(",")))
    rng = np.random.default_rng(0)
    results = {}
    for form in args.forms.split(","):
        layers = build(form, shapes, rng)
        results[form] = {}
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, layer.in_features).bfloat16() for layer in layers]
            stream = sum(median_seconds(lambda: layer.stream(packed, x, torch.bfloat16),
                                        args.repeats) for layer, x in zip(layers, xs))
            gemm = sum(median_seconds(
                lambda: ops.linear(x, layer.dequantize(packed, torch.bfloat16), None),
                args.repeats) for layer, x in zip(layers, xs))
            ops_count = sum(2 * rows * out * into for out, into in shapes)
            results[form][rows] = {
                "stream_ms": round(stream * 1e3, 3), "gemm_ms": round(gemm * 1e3, 3),
                "stream_gop_s": round(ops_count / stream / 1e9), "gemm_gop_s":
                round(ops_count / gemm / 1e9), "gemm_over_stream": round(gemm / stream, 2)}
    streamed = kernel_max_rows(packed, torch.bfloat16)
    print(json.dumps({
        "cpu": cpu_name(), "torch_threads":
        torch.get_num_threads(), "widens_bf16_gemms": packed.widens_bf16_gemms,
        "kernel_max_rows_bf16": None if streamed == sys.maxsize else streamed,  # None: all
        "shapes": shapes, "forms": results}, indent=1))


if __name__ == "__main__":
    main()
