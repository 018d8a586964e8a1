"""How fast this machine reads memory: a buffer far larger than the caches, on ordinary or
on huge pages (huge_pages says why the engine uses them), and the memory the engine's
weights themselves sit in. A decode step streams every weight once, so these bound its
speed; the benches hold the engines against them (bench/roofline.py)."""

import time

import torch

from kvscope.engine.worker import huge_pages

BANDWIDTH_BYTES = 512 << 20  # well past every cache level


def best_seconds(function, repeats: int) -> float:
    function()  # warm-up: page faults, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def read_bandwidth(huge: bool, repeats: int = 5) -> float:
    """Bytes/s that a reduction reads a buffer far larger than the caches at, on ordinary
    or on huge pages (the engine puts its weights and KV cache on huge pages)."""
    shape = (BANDWIDTH_BYTES // 4,)
    data = (huge_pages.empty(shape, torch.float32) if huge else torch.empty(shape)).fill_(1.0)
    return BANDWIDTH_BYTES / best_seconds(data.sum, repeats)


def weights_read_bandwidth(tensors, repeats: int = 5) -> float:
    """Bytes/s that the same reduction reads the memory holding `tensors` at (each storage
    whole, as int64 words). On some hosts the memory behind one buffer reads at twice the
    speed of another's, so the probe buffer of read_bandwidth can land apart from the
    weights; this measures the weights' own."""
    words = storage_words(tensors)
    total = sum(word.numel() * 8 for word in words)
    return total / best_seconds(lambda: [word.sum() for word in words], repeats)


def storage_words(tensors) -> list[torch.Tensor]:
    """Each distinct storage under `tensors` once, whole, viewed as int64 words (an integer
    sum has no slow path for the bit patterns that bf16 pairs make as floats)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage
    return [torch.empty(0, dtype=torch.int64).set_(storage, 0, (storage.nbytes() // 8,))
            for storage in storages.values()]
