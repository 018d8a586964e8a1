"""What this machine allows, measured in the same run as the engines it is compared with:
memory read bandwidth (kvscope.engine.worker.memory_bandwidth's probe), best of a few tries, and
dense GEMM throughput (fp32 and bf16), the fastest call after a warm-up (gemm_flops), on
torch's threads."""

import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch

from kvscope.engine.worker.memory_bandwidth import read_bandwidth

GEMM_SIZE = 1024
# The matrix units reach their rate only after a while in use: on an AMX Xeon a 2048^3 bf16
# GEMM ran at a third of its rate for its first fraction of a second, so a few calls timed
# from cold measured a third of the machine (docs/performance-history.md, 'The GEMM rate was
# measured cold on AMX'). The best call of a second's worth after the warm-up: a shared
# host's rate swings within seconds.
WARM_UP_SECONDS = 0.5
TIMED_SECONDS = 1.0


def gemm_flops(dtype: torch.dtype, size: int = GEMM_SIZE) -> float:
    """FLOP/s of a square torch.mm in `dtype`: its fastest call in TIMED_SECONDS of calls
    after WARM_UP_SECONDS of them (at least one call timed, however slow)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    best, started = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - started < WARM_UP_SECONDS + TIMED_SECONDS:
        call_started = time.perf_counter()
        torch.mm(a, b)
        if call_started - started >= WARM_UP_SECONDS:
            best = min(best, time.perf_counter() - call_started)
    return 2 * size ** 3 / best


# A single stream without speculation reads every weight once per token, so it can never
# read faster than memory allows: a share of the probe's limit above this is the probe
# under-reading the memory (memory_bandwidth's docstring), not the engine beating it.
MOST_A_STREAM_CAN_READ = 1.0


def read_bandwidths() -> dict[str, float]:
    """Bytes/s the bandwidth probe (memory_bandwidth.read_bandwidth) reads at on ordinary
    and on huge pages; the limit every share is measured against is the faster of the two."""
    return {"4k_pages": read_bandwidth(huge=False), "huge_pages": read_bandwidth(huge=True)}


def probe_check(shares: dict[str, float]) -> dict:
    """What a single stream's (without speculation) shares of the bandwidth limits say of the
    probe: {"probe_beaten": False}, or True with a note naming the shares above
    MOST_A_STREAM_CAN_READ."""
    beaten = {name: share for name, share in shares.items() if share > MOST_A_STREAM_CAN_READ}
    if not beaten:
        return {"probe_beaten": False}
    return {"probe_beaten": True,
            "probe_note": f"{', '.join(f'{name} = {share}' for name, share in beaten.items())} "
                          f"> {MOST_A_STREAM_CAN_READ}: a stream that reads every weight once "
                          "per token cannot beat the memory, so the bandwidth probe under-read "
                          "it on this host; these shares overstate the engine"}


def measure() -> dict:
    by_pages = read_bandwidths()
    return {
        "read_bandwidth_gb_s": round(max(by_pages.values()) / 1e9, 2),
        "read_bandwidth_by_pages_gb_s": {name: round(value / 1e9, 2)
                                         for name, value in by_pages.items()},
        "gemm_gflop_s": {str(dtype).removeprefix("torch."): round(gemm_flops(dtype) / 1e9, 1)
                         for dtype in (torch.float32, torch.bfloat16)},
        "gemm_size": GEMM_SIZE,
    }


def model_costs(config, dtype: torch.dtype) -> dict:
    """Weight bytes a decode step reads and matmul FLOPs per token of the model that
    transformers' `config` describes (2 per weight; the embedding lookup reads one row,
    but a tied lm_head reads the whole table). An engine's runner has its config as
    `hf_config`, a GGUF file's included."""
    from kvscope.engine.worker.models import model_class

    with torch.device("meta"):
        model = model_class(config)(config, 16, 16)
    params = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    # Every parameter is read once per step; an untied lm_head is a parameter too, a tied
    # one reads the embedding table (counted once) for the logits.
    read = params if getattr(config, "tie_word_embeddings", False) else params - embedding
    return {"parameters": params, "weight_bytes_per_step": read * dtype.itemsize,
            "matmul_flops_per_token": 2 * read}


def cpu_name() -> str:
    """The CPU's model name, as every bench's JSON names it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()
