"""Where a workload's step time goes, per phase, each part against its own limit.

A sample of an engine's steps (every --phase-profile-every-th, so the profiler's cost stays
a small part of the run) is profiled with torch.profiler; the C++ decoder stack calls its ops
through torch's dispatcher, so they show under their names as the eager layers' do. A step
with any prefill chunk is a prefill step, else a decode step. Per phase, over its sampled
steps:

  gemm       the linears' own time (GEMM_OPS); its limit is the step's slower bound of
             matmul FLOPs / the plain F.linear rate measured in the same run (prefill) and
             the weight bytes / the read bandwidth (decode: every weight is read once per
             step); share_of_limit = that limit / the time
  attention  paged_attention and store_kv; its limit is the K/V bytes the step reads / the
             read bandwidth
  rest       the step's time outside both: norms, rotary, sampling, scheduling, Python

bench/throughput.py runs it on a pass of its own after the timed ones (--phase-profile).
"""

import contextlib
import os
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function, schedule

# The ops a linear runs as, on every backend (the streaming kernels, oneDNN's GEMM over a
# plain or a prepacked weight, the widened bf16 GEMM: its own time is the weight's widening
# and the rounding of the result around its fp32 aten::mm; the packed int4 / int8 / GGUF
# kernels, and their de-quantization before a GEMM of many rows).
GEMM_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "kvscope::linear_small_batch",
            "kvscope::linear_blocked", "kvscope::linear_widened",
            "kvscope::int4_linear", "kvscope::int8_linear", "kvscope::gguf_linear",
            "kvscope::int4_dequantize", "kvscope::int8_dequantize", "kvscope::gguf_dequantize")
ATTENTION_OPS = ("kvscope::paged_attention", "kvscope::store_kv")
STEP_LABEL = "kvscope step"
PHASES = ("prefill", "decode")
# The plain F.linear the prefill GEMMs are held to: rows of a prefill chunk.
PLAIN_LINEAR_ROWS = 2048
PLAIN_LINEAR_SECONDS = 1.0


@dataclass
class PhaseSample:
    """One phase's sampled steps: their seconds in all and in each part, and the work the
    limits are computed from."""

    steps: int = 0
    step_seconds: float = 0.0
    gemm_seconds: float = 0.0
    attention_seconds: float = 0.0
    matmul_flops: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0


def self_seconds(events, names) -> float:
    return sum(event.self_cpu_time_total for event in events if event.key in names) / 1e6


@contextlib.contextmanager
def sampled_phases(engine, cost, weight_bytes: int, every: int):
    """Profile every `every`-th engine.step() while the block runs; yields {phase:
    PhaseSample}, filled when the block ends. cost(record) -> (matmul FLOPs, K/V bytes) of a
    step (throughput.step_costs); weight_bytes: what a step reads of the weights."""
    phases = {name: PhaseSample() for name in PHASES}
    records, step = [], engine.step

    def sampled(prof) -> None:
        record = records[-1]
        phase = phases["prefill" if any(kind == "prefill" for _, _, kind, _, _ in record.chunks)
                       else "decode"]
        events = prof.key_averages()
        flops, kv_bytes = cost(record)
        phase.steps += 1
        phase.step_seconds += sum(e.cpu_time_total for e in events if e.key == STEP_LABEL) / 1e6
        phase.gemm_seconds += self_seconds(events, GEMM_OPS)
        phase.attention_seconds += self_seconds(events, ATTENTION_OPS)
        phase.matmul_flops += flops
        phase.weight_bytes += weight_bytes
        phase.kv_bytes += kv_bytes

    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=sampled,
                 schedule=schedule(wait=every - 1, warmup=0, active=1)) as prof:
        def stepping(*args, **kwargs):
            with record_function(STEP_LABEL):
                result = step(*args, **kwargs)
            records.append(result.record)
            prof.step()
            return result

        engine.step = stepping
        try:
            yield phases
        finally:
            del engine.step  # the class's method again


def plain_linear_flops(in_features: int, out_features: int, dtype: torch.dtype) -> float:
    """FLOP/s of F.linear on a plain [out, in] weight over PLAIN_LINEAR_ROWS rows: the best
    call in PLAIN_LINEAR_SECONDS after one warm-up call."""
    x = torch.randn(PLAIN_LINEAR_ROWS, in_features).to(dtype)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(dtype)
    F.linear(x, weight)
    best, started = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - started < PLAIN_LINEAR_SECONDS:
        call_started = time.perf_counter()
        F.linear(x, weight)
        best = min(best, time.perf_counter() - call_started)
    return 2 * PLAIN_LINEAR_ROWS * in_features * out_features / best


def phase_report(phases: dict[str, PhaseSample], gemm_rate: float, bandwidth: float) -> dict:
    """Per phase: its sampled steps' milliseconds per step in each part and each part's share
    of its own limit (the module's docstring); rest as its share of the step."""
    report = {}
    for name, phase in phases.items():
        if not phase.steps:
            continue
        rest = phase.step_seconds - phase.gemm_seconds - phase.attention_seconds
        gemm_limit = max(phase.matmul_flops / gemm_rate, phase.weight_bytes / bandwidth)
        report[name] = {
            **asdict(phase),
            "ms_per_step": {part: round(seconds / phase.steps * 1e3, 3) for part, seconds in
                            (("step", phase.step_seconds), ("gemm", phase.gemm_seconds),
                             ("attention", phase.attention_seconds), ("rest", rest))},
            "gemm_share_of_limit": share(gemm_limit, phase.gemm_seconds),
            "gemm_bound": ("flops" if phase.matmul_flops / gemm_rate
                           > phase.weight_bytes / bandwidth else "weight_bytes"),
            "attention_share_of_limit": share(phase.kv_bytes / bandwidth, phase.attention_seconds),
            "rest_share_of_step": share(rest, phase.step_seconds),
        }
    return report


def share(part: float, whole: float) -> float | None:
    return round(part / whole, 3) if whole > 0 else None
