"""The GEMM rate this machine allows, and what the engine's linears reach, per row count.

  large            torch.mm of two --large-size square matrices, per dtype: the rate on a
                   shape that hides every overhead (the limit the others are held to)
  plain_<dtype>    the engine's cpu linear on each linear's plain [out, in] weight in that
                   dtype: F.linear (oneDNN; on bf16 it reorders the weight inside every call)
                   for more than 32 rows, the one-read streaming kernel for up to 32
  onednn_bfloat16  F.linear on the plain bf16 weight at every row count: oneDNN's bf16 GEMM,
                   which the engine's linear replaces on a CPU without bf16 dot products
                   (there plain_bfloat16 is the widened fp32 GEMM of
                   kernels/csrc/widened_gemm.cpp from WIDENED_MIN_ROWS = 48 rows); only on
                   such CPUs
  plain_<dtype>_huge_pages  with --huge-pages: plain_<dtype> on the same weights moved
                   onto huge pages as the engine moves a model's (huge_pages.move_module):
                   the page size's own effect on the GEMMs, in the same run
  prepacked        the engine's cpu linear (kernels/cpu_kernels.py) on the bf16 weight
                   prepacked (prepack_weight): kvscope's 64-output tiles through the
                   blocked kernel at every row count, or where the CPU has AMX oneDNN's
                   tiles, its GEMM past 5 rows. Only where the kernels take tiles
                   (AVX512-BF16); elsewhere the report says why it is absent

--dtypes defaults to float32 and bfloat16 both: the engine's dtype="auto" runs float32 on a
CPU without native bf16 matmuls (no AVX512-BF16 or AMX), and the two rates side by side show
what that choice is worth here. There the bf16 forms are held to the fp32 large rate, the
route the engine's bf16 GEMMs take.

Every linear of the model (the default one unless --model; random weights) is built in each
form, so a pass reads as many weight bytes as a forward does (one layer timed alone would
sit in the caches). The lm_head counts only up to 256 rows: a prefill computes logits for a
chunk's last tokens only. The forms take turns, best of --repeats, so a machine that other
work shares slows them alike. Prints JSON: GFLOP/s per form and row count, and each as a
share of `large` in the form's dtype.

Usage:
  flock /work/bench.lock python bench/gemm_rate.py
  flock /work/bench.lock python bench/gemm_rate.py --rows 8,64,256,2048 --threads 2 --dtypes bfloat16
"""

import argparse
import json
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import roofline  # noqa: E402
import torch
import torch.nn.functional as F
from quantized_linear import model_linears  # noqa: E402
from served import cpu_name  # noqa: E402

from kvscope.engine.worker import huge_pages  # noqa: E402
from kvscope.engine.worker.loader import load_config, resolve_model_path  # noqa: E402
from kvscope.engine.worker.model_runner import resolve_dtype  # noqa: E402
from kvscope.kernels import cpu_kernels  # noqa: E402

LARGE_SIZE = 2048
HEAD_MAX_ROWS = 256


def large_gemm_flops(dtype: torch.dtype, size: int = LARGE_SIZE) -> float:
    """FLOP/s of a square torch.mm in `dtype`: what the matrix or vector units reach with
    nothing around them (a phase is held to the rate of the dtype it runs in). On a CPU
    without bf16 dot products the engine's bf16 GEMMs run in fp32 (widened weight tiles), so
    bf16 is held to the fp32 rate there."""
    cpu_kernels.load()
    if dtype == torch.bfloat16 and cpu_kernels.widens_bf16_gemms():
        dtype = torch.float32
    return roofline.gemm_flops(dtype, size)


def weight_forms(shapes, dtypes: list[torch.dtype],
                 huge: bool = False) -> dict[str, tuple[torch.dtype, list, Callable]]:
    """form -> (its activations' dtype, [(kind, weight)] for every linear, the linear)."""
    ops = cpu_kernels.kernel_ops()
    plain = {dtype: [(kind, (torch.randn(n, k) / k ** 0.5).to(dtype)) for kind, n, k in shapes]
             for dtype in dtypes}
    forms = {f"plain_{dtype_name(dtype)}": (dtype, weights, ops.linear)
             for dtype, weights in plain.items()}
    if huge:
        forms.update({f"plain_{dtype_name(dtype)}_huge_pages": (dtype, on_huge_pages(weights), ops.linear)
                      for dtype, weights in plain.items()})
    if torch.bfloat16 in plain and cpu_kernels.widens_bf16_gemms():
        forms["onednn_bfloat16"] = (torch.bfloat16, plain[torch.bfloat16], F.linear)
    if ops.prepack_weight is not None and torch.bfloat16 in plain:
        packed = [(kind, ops.prepack_weight(weight)) for kind, weight in plain[torch.bfloat16]]
        forms["prepacked"] = (torch.bfloat16,
                              [(kind, weight) for kind, weight in packed if weight is not None],
                              ops.linear)
    return forms


def on_huge_pages(layers: list) -> list:
    """Copies of [(kind, weight)] in one huge-page region, as the engine's model is moved."""
    module = torch.nn.ParameterList(torch.nn.Parameter(weight.clone(), requires_grad=False)
                                    for _, weight in layers)
    huge_pages.move_module(module)
    return [(kind, parameter.data) for (kind, _), parameter in zip(layers, module)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def linear_rates(forms: dict, shapes, rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """form -> rows -> FLOP/s of one pass over the model's linears."""
    rates: dict[str, dict[int, float]] = {form: {} for form in forms}
    for count in rows:
        xs = {(dtype, k): torch.randn(count, k).to(dtype)
              for dtype, _, _ in forms.values() for _, _, k in shapes}
        used = [(n, k) for kind, n, k in shapes if kind != "lm_head" or count <= HEAD_MAX_ROWS]
        flops = sum(2 * count * n * k for n, k in used)
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(repeats):
            for form, (dtype, layers, linear) in forms.items():
                started = time.perf_counter()
                for kind, weight in layers:
                    if kind != "lm_head" or count <= HEAD_MAX_ROWS:
                        linear(xs[dtype, in_features(weight)], weight)
                best[form] = min(best[form], time.perf_counter() - started)
        for form in forms:
            rates[form][count] = flops / best[form]
    return rates


def in_features(weight) -> int:
    return weight.in_features if isinstance(weight, cpu_kernels.PrepackedWeight) else weight.shape[1]


def measure(model: str | None, rows: list[int], dtypes: list[torch.dtype], repeats: int = 3,
            huge: bool = False) -> dict:
    """The large-GEMM rate per dtype and every form's per row count, GFLOP/s and shares of
    the large rate in the form's dtype."""
    large = {dtype: large_gemm_flops(dtype) for dtype in dtypes}
    shapes = model_linears(load_config(resolve_model_path(model)))
    forms = weight_forms(shapes, dtypes, huge)
    rates = linear_rates(forms, shapes, rows, repeats)
    report = {
        "large_gemm_gflop_s": {dtype_name(d): round(v / 1e9, 1) for d, v in large.items()},
        "large_gemm_size": LARGE_SIZE,
        "linears_gflop_s": {form: {str(r): round(v / 1e9, 1) for r, v in by_rows.items()}
                            for form, by_rows in rates.items()},
        "share_of_large": {form: {str(r): round(v / large[forms[form][0]], 3) for r, v in by_rows.items()}
                           for form, by_rows in rates.items()},
    }
    if cpu_kernels.kernel_ops().prepack_weight is None:
        report["prepacked"] = ("absent: the kernels were built without AVX512-BF16, so nothing "
                               "reads tiled weights (kernel_ops().prepack_weight is None)")
    elif "prepacked" not in forms:
        report["prepacked"] = "absent: no bfloat16 in --dtypes"
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,512,2048")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--huge-pages", action="store_true",
                        help="also each plain form on huge pages (plain_<dtype>_huge_pages)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["engine_auto_dtype"] = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    report.update(measure(args.model, [int(r) for r in args.rows.split(",")],
                          [getattr(torch, name) for name in args.dtypes.split(",")], args.repeats,
                          args.huge_pages))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
