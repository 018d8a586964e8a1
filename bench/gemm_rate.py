"""The bf16 GEMM rate this machine allows, and what the engine's linears reach, per row count.

  large            torch.mm of two --large-size square bf16 matrices: the matrix units' rate
                   on a shape that hides every overhead (the limit the others are held to)
  plain            the engine's cpu linear on each linear's plain [out, in] weight, as it ran
                   before it prepacked: F.linear (oneDNN, which reorders the weight inside
                   every call) for more than 5 rows, the one-read streaming kernel for fewer
  prepacked        the engine's cpu linear (kernels/cpu_kernels.py) on the weight prepacked in
                   oneDNN's AMX layout: its GEMM for more than 5 rows, the streaming kernel
                   for up to 5

Every linear of the model (the default one unless --model; random weights) is built in both
forms, so a pass reads as many weight bytes as a forward does (one layer timed alone would
sit in the caches). The lm_head counts only up to 256 rows: a prefill computes logits for a
chunk's last tokens only. The forms take turns, best of --repeats, so a machine that other
work shares slows them alike. Prints JSON: GFLOP/s per form and row count, and each as a
share of `large`.

Usage:
  flock /work/bench.lock python bench/gemm_rate.py
  flock /work/bench.lock python bench/gemm_rate.py --rows 8,64,256,2048 --threads 2
"""

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from quantized_linear import model_linears  # noqa: E402
from served import cpu_name  # noqa: E402

from kvscope.engine.worker.loader import load_config, resolve_model_path  # noqa: E402
from kvscope.engine.worker.memory_bandwidth import best_seconds  # noqa: E402
from kvscope.kernels import cpu_kernels  # noqa: E402

LARGE_SIZE = 2048
HEAD_MAX_ROWS = 256


def large_gemm_flops(size: int = LARGE_SIZE, repeats: int = 5) -> float:
    """FLOP/s of a square bf16 torch.mm: what the matrix units reach with nothing around them."""
    a, b = torch.randn(size, size).bfloat16(), torch.randn(size, size).bfloat16()
    return 2 * size ** 3 / best_seconds(lambda: torch.mm(a, b), repeats)


def linear_rates(config, rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """form -> rows -> FLOP/s of one pass over the model's linears."""
    ops = cpu_kernels.kernel_ops()
    shapes = model_linears(config)
    plain = [(kind, (torch.randn(n, k) / k ** 0.5).bfloat16()) for kind, n, k in shapes]
    packed = [(kind, ops.prepack_weight(weight)) for kind, weight in plain]
    forms = {"plain": plain, "prepacked": [(kind, weight) for kind, weight in packed if weight is not None]}
    rates: dict[str, dict[int, float]] = {form: {} for form in forms}
    for count in rows:
        xs = {k: torch.randn(count, k).bfloat16() for _, _, k in shapes}
        used = [(n, k) for kind, n, k in shapes if kind != "lm_head" or count <= HEAD_MAX_ROWS]
        flops = sum(2 * count * n * k for n, k in used)
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(repeats):
            for form, layers in forms.items():
                started = time.perf_counter()
                for kind, weight in layers:
                    if kind != "lm_head" or count <= HEAD_MAX_ROWS:
                        ops.linear(xs[in_features(weight)], weight)
                best[form] = min(best[form], time.perf_counter() - started)
        for form in forms:
            rates[form][count] = flops / best[form]
    return rates


def in_features(weight) -> int:
    return weight.in_features if isinstance(weight, cpu_kernels.PrepackedWeight) else weight.shape[1]


def measure(model: str | None, rows: list[int], repeats: int = 3) -> dict:
    """The large-GEMM rate and every form's per row count, GFLOP/s and shares of it."""
    large = large_gemm_flops()
    rates = linear_rates(load_config(resolve_model_path(model)), rows, repeats)
    return {
        "large_gemm_gflop_s": round(large / 1e9, 1), "large_gemm_size": LARGE_SIZE,
        "linears_gflop_s": {form: {str(r): round(v / 1e9, 1) for r, v in by_rows.items()}
                            for form, by_rows in rates.items()},
        "share_of_large": {form: {str(r): round(v / large, 3) for r, v in by_rows.items()}
                           for form, by_rows in rates.items()},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,512,2048")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    report.update(measure(args.model, [int(r) for r in args.rows.split(",")], args.repeats))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
