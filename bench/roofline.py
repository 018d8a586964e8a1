"""What this machine allows, measured in the same run as the engines it is compared with:
memory read bandwidth and dense GEMM throughput (fp32 and bf16), best of a few tries, on
torch's threads."""

import time

import torch

BANDWIDTH_BYTES = 512 << 20  # well past every cache level
GEMM_SIZE = 1024


def best_seconds(function, repeats: int) -> float:
    function()  # warm-up: page faults, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes/s that a reduction reads a buffer far larger than the caches at."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    return BANDWIDTH_BYTES / best_seconds(data.sum, repeats)


def gemm_flops(dtype: torch.dtype, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size ** 3 / best_seconds(lambda: torch.mm(a, b), repeats)


def measure() -> dict:
    return {
        "read_bandwidth_gb_s": round(read_bandwidth() / 1e9, 2),
        "gemm_gflop_s": {str(dtype).removeprefix("torch."): round(gemm_flops(dtype) / 1e9, 1)
                         for dtype in (torch.float32, torch.bfloat16)},
        "gemm_size": GEMM_SIZE,
    }


def model_costs(model_path, dtype: torch.dtype) -> dict:
    """Weight bytes a decode step reads and matmul FLOPs per token (2 per weight; the
    embedding lookup reads one row, but a tied lm_head reads the whole table)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    from engine.models import model_class

    with torch.device("meta"):
        model = model_class(config)(config, 16)
    params = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    # Every parameter is read once per step; an untied lm_head is a parameter too, a tied
    # one reads the embedding table (counted once) for the logits.
    read = params if getattr(config, "tie_word_embeddings", False) else params - embedding
    return {"parameters": params, "weight_bytes_per_step": read * dtype.itemsize,
            "matmul_flops_per_token": 2 * read}
