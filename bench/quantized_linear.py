"""The model's linears on packed int4 / int8 weights against dense ones, per row count.

It builds every linear of the model (the default one unless --model) with random weights
in each form, so one pass reads as many weight bytes from memory as a decode step does
(one layer timed alone would sit in the caches), and times passes over all of them with
x of each number of rows:

  dense            F.linear (oneDNN) on the weight in --dtype (bf16 unless told), and for
  dense_row_kernel one row the engine's dense one-row kernel (kvscope::linear_small_batch,
                   the dense single stream's path)
  int8, int4       the engine's Int8Linear / Int4Linear (streaming kernel up to
                   KERNEL_MAX_ROWS rows, GEMM beyond); int4 reads the lm_head as int8
  torch_int8, torch_int4   PyTorch's packed CPU matmuls (_weight_int8pack_mm,
                   _weight_int4pack_mm_for_cpu) on the same weights, for comparison
  mxfp4            the weight quantized to MXFP4 (gpt-oss's experts' format, kernels/mxfp4.py)
                   through the streaming kernel (mxfp4_linear) at every row count; the
                   lm_head as int8
  gguf_<TYPE>      with --gguf-types, GgufLinear on random valid blocks of that GGUF type
                   (quantization="gguf"), every layer in it (a width no multiple of the
                   type's block falls back to Q8_0), the lm_head too; and each as
                   gguf_<TYPE>_lanes, its rows repacked into the int4 kernels' layout
                   (GgufLinear.repack), the form a bf16 model's layers load into where the
                   kernels have AVX512-VNNI

It prints JSON: per form and row count the median ms of a pass, the weight GB/s that
implies, and each layer kind's share, next to the read bandwidth bench/roofline.py
measures in the same run.

Usage:
  flock /work/bench.lock python bench/quantized_linear.py --rows 1,8,64 --threads 1,2
  python bench/quantized_linear.py --model <Qwen3-0.6B-shaped folder> --rows 1,32 \
      --gguf-types Q4_K,Q5_K,Q6_K,Q8_0
"""

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import numpy as np
import roofline  # noqa: E402
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES

from kvscope.engine.worker.loader import load_config, resolve_model_path  # noqa: E402
from kvscope.engine.worker.models.quantized import (  # noqa: E402
    KERNEL_MAX_ROWS,
    GgufBlocks,
    GgufLinear,
    Int4Linear,
    Int8Linear,
    pack_model,
)
from kvscope.kernels import cpu_kernels, gguf_blocks, mxfp4  # noqa: E402
from kvscope.kernels.gguf_lanes import LANES, int4_wide_blocks  # noqa: E402

CPU = torch.device("cpu")


def model_linears(config) -> list[tuple[str, int, int]]:
    """(kind, out_features, in_features) of every linear of a Llama-family model, in the
    order a forward runs them (a tied lm_head reads the embedding table: counted once)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = [("qkv", qkv, config.hidden_size),
             ("o", config.hidden_size, config.num_attention_heads * head_dim),
             ("gate_up", 2 * config.intermediate_size, config.hidden_size),
             ("down", config.hidden_size, config.intermediate_size)]
    return layer * config.num_hidden_layers + [("lm_head", config.vocab_size, config.hidden_size)]


def random_weight(out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features) / in_features ** 0.5


def packed(layer, weight: torch.Tensor, dtype: torch.dtype):
    layer.load_part("weight", 0, weight)
    pack_model(layer, dtype, CPU)
    layer.ops = cpu_kernels.kernel_ops()
    return layer


def forms(out_features: int, in_features: int, group_size: int, is_lm_head: bool,
          dtype: torch.dtype) -> dict:
    """form -> (forward, weight bytes it reads) for one random weight, activations `dtype`."""
    weight = random_weight(out_features, in_features)
    dense = weight.to(dtype)
    int8 = packed(Int8Linear(in_features, [out_features], bias=False), weight, dtype)
    int8_scales = int8.scales.to(dtype)  # the torch op wants x's dtype
    row_kernel = cpu_kernels.kernel_ops().linear
    found = {
        "dense": (lambda x: F.linear(x, dense), dense.nbytes),
        "dense_row_kernel": (lambda x: row_kernel(x, dense), dense.nbytes),
        "int8": (int8, int8.weight.nbytes + int8.scales.nbytes),
        "torch_int8": (lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.weight, int8_scales),
                       int8.weight.nbytes + int8_scales.nbytes),
    }
    if is_lm_head:  # int8 in every quantized mode
        found["int4"], found["torch_int4"] = found["int8"], found["torch_int8"]
        found["mxfp4"] = found["int8"]
        return found
    blocks, scales = mxfp4.quantize(weight)
    mxfp4_linear = cpu_kernels.kernel_ops().packed.mxfp4_linear
    found["mxfp4"] = (lambda x: mxfp4_linear(x, blocks, scales, None),
                      blocks.nbytes + scales.nbytes)
    int4 = packed(Int4Linear(in_features, [out_features], bias=False, group_size=group_size),
                  weight, dtype)
    found["int4"] = (int4, int4.weight.nbytes + int4.scales.nbytes + int4.offsets.nbytes)
    found["torch_int4"] = torch_int4(int4, dtype)
    return found


def gguf_forms(out_features: int, in_features: int, types: list[str], dtype: torch.dtype,
               rng: np.random.Generator) -> dict:
    """form -> (forward, weight bytes) for random blocks of each GGUF type in `types`."""
    found = {}
    for name in types:
        kind = gguf_blocks.Q[name]
        block = GGML_QUANT_SIZES[kind][0]
        used = kind if in_features % block == 0 else gguf_blocks.Q.Q8_0
        blocks = torch.from_numpy(gguf_blocks.random_blocks(used, out_features, in_features, rng))
        forms = [f"gguf_{name}"] + ([f"gguf_{name}_lanes"] if used in LANES else [])
        for form in forms:
            layer = GgufLinear(in_features, [out_features], bias=False)
            layer.load_part("weight", 0, GgufBlocks(used, blocks, in_features))
            layer.pack(dtype, CPU)
            if form.endswith("_lanes"):
                layer.repack(lambda kind: LANES.get(kind, -1))
            layer.ops = cpu_kernels.kernel_ops()
            found[form] = (layer, sum(w.nbytes for w in layer.weights))
    return found


def torch_int4(layer: Int4Linear, dtype: torch.dtype):
    """PyTorch's packed int4 matmul on the same q, scale and offset."""
    chunks = int4_wide_blocks(layer.weight, inverse=True).view(layer.out_features, -1, 16)
    q = torch.cat([chunks & 15, chunks >> 4], dim=-1).view(layer.out_features, -1)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    scale, offset = layer.scales.float(), layer.offsets.float()
    # Its formula is (q - 8) * scale + zero, so zero = offset + 8 * scale.
    scales_and_zeros = torch.stack([scale.t(), (offset + 8 * scale).t()], -1).to(dtype)
    group = layer.group_size

    def forward(x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, scales_and_zeros)
    return forward, weight.nbytes + scales_and_zeros.nbytes


def time_passes(model: list[tuple[str, object]], x: torch.Tensor, seconds: float) -> dict:
    """Median ms of a pass over every layer, and each layer kind's median ms within one."""
    inputs = {}
    passes = []
    deadline = None
    while len(passes) < 3 or time.perf_counter() < deadline:
        kinds = {}
        for kind, forward in model:
            inputs.setdefault(kind, x[:, :forward.in_features].contiguous())
            started = time.perf_counter()
            forward(inputs[kind])
            kinds[kind] = kinds.get(kind, 0.0) + time.perf_counter() - started
        passes.append(kinds)
        deadline = deadline or time.perf_counter() + seconds  # the first pass warms up
    passes = passes[1:]
    return {"ms": statistics.median(sum(p.values()) for p in passes) * 1e3,
            "kinds_ms": {kind: round(statistics.median(p[kind] for p in passes) * 1e3, 3)
                         for kind in passes[0]}}


class Forward:
    """A form's forward with the input width it takes."""

    def __init__(self, forward, in_features: int) -> None:
        self.forward, self.in_features = forward, in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default=f"1,{KERNEL_MAX_ROWS},16,64")
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="activations (and the dense weights)")
    parser.add_argument("--gguf-types", default="",
                        help="comma-separated GGUF types (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0...) "
                             "to time as gguf_<TYPE> forms too")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="timing per form and row count")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    linears = model_linears(load_config(resolve_model_path(args.model)))
    report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "kernel_max_rows": KERNEL_MAX_ROWS, "group_size": args.group_size,
              "dtype": args.dtype,
              "roofline": roofline.measure(), "results": {}}
    gguf_types = [name for name in args.gguf_types.split(",") if name]
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        models, nbytes = {}, {}
        for kind, out_features, in_features in linears:
            found = {**forms(out_features, in_features, args.group_size, kind == "lm_head", dtype),
                     **gguf_forms(out_features, in_features, gguf_types, dtype, rng)}
            for form, (forward, size) in found.items():
                models.setdefault(form, []).append((kind, Forward(forward, in_features)))
                nbytes[form] = nbytes.get(form, 0) + size
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in rows_list:
                x = torch.randn(rows, max(inp for _, _, inp in linears)).to(dtype)
                for form, model in models.items():
                    if form == "dense_row_kernel" and rows != 1:
                        continue
                    timing = time_passes(model, x, args.seconds)
                    report["results"][f"{form} rows={rows} threads={threads}"] = {
                        "ms": round(timing["ms"], 2),
                        "weight_gb_s": round(nbytes[form] / timing["ms"] / 1e6, 2),
                        "kinds_ms": timing["kinds_ms"]}
    report["weight_mb"] = {form: round(size / 1e6, 1) for form, size in nbytes.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
