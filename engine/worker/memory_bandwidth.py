"""How fast this machine reads memory: the probe every bandwidth share is held against
(bench/roofline.py, bench/throughput.py), and the memory the engine's weights sit in. A
decode step streams every weight once, so these bound its speed.

A share above 1.0 can only mean the probe under-read the memory, so it reads the way the
engine's fastest loop does (docs/performance.md, "The bandwidth probe"):
- a buffer at least PROBE_LLC_MULTIPLE times the last-level cache (and at least
  PROBE_FLOOR_BYTES), so at most a quarter of it can be a cache hit;
- on the engine's huge pages (huge_pages.empty, which the weights are moved into) or on
  ordinary pages;
- on the threads the C++ kernels run on (the work pool, one contiguous share each), with
  a loop that does one vector add per 64-byte load (KernelOps.read_words): torch's sum, the
  earlier probe, let single streams report 1.03-1.13 of its limit on an AMX Xeon.
"""

import time
from pathlib import Path

import torch

from kvscope.engine.worker import huge_pages
from kvscope.kernels import select_ops

PROBE_FLOOR_BYTES = 512 << 20
PROBE_LLC_MULTIPLE = 4
CPU_ROOT = Path("/sys/devices/system/cpu")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def best_seconds(function, repeats: int) -> float:
    function()  # warm-up: page faults, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def last_level_cache_bytes(cpu_root: Path = CPU_ROOT) -> int:
    """The machine's last-level cache: the highest data or unified cache level sysfs lists,
    each instance (one set of CPUs sharing it: a socket's, or a Zen CCD's L3) counted once.
    0 where sysfs does not say."""
    level_seen, instances = 0, {}
    for index in cpu_root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = cache_size_bytes((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if level > level_seen:
            level_seen, instances = level, {}
        if level == level_seen:
            instances[shared] = size
    return sum(instances.values())


def cache_size_bytes(text: str) -> int:
    """sysfs's cache size ("32768K", "1M", or plain bytes) in bytes; ValueError otherwise."""
    text = text.strip()
    unit = _SIZE_UNITS.get(text[-1:].upper())
    return int(text[:-1]) * unit if unit else int(text)


def probe_bytes(llc_bytes: int) -> int:
    """The probe buffer's size: PROBE_LLC_MULTIPLE times the last-level cache, at least
    PROBE_FLOOR_BYTES, in whole huge pages."""
    wanted = max(PROBE_FLOOR_BYTES, PROBE_LLC_MULTIPLE * llc_bytes)
    return -(-wanted // huge_pages.HUGE_PAGE_BYTES) * huge_pages.HUGE_PAGE_BYTES


def read_bandwidth(huge: bool, repeats: int = 5) -> float:
    """Bytes/s at which the kernels' threads read a buffer of probe_bytes() on the engine's
    huge pages (huge_pages.empty: the weights' and the KV pool's allocator) or on ordinary
    pages; the best of `repeats` reads after one to fault it in."""
    words = probe_bytes(last_level_cache_bytes()) // 8
    data = huge_pages.empty((words,), torch.int64) if huge else torch.ones(words, dtype=torch.int64)
    read_words = select_ops(torch.device("cpu")).read_words
    return words * 8 / best_seconds(lambda: read_words(data), repeats)


def weights_read_bandwidth(tensors, repeats: int = 5) -> float:
    """Bytes/s at which the same loop reads the memory holding `tensors` (each storage
    whole, as int64 words). On some hosts the memory behind one buffer reads at twice the
    speed of another's, so the probe buffer of read_bandwidth can land apart from the
    weights; this measures the weights' own."""
    words = storage_words(tensors)
    total = sum(word.numel() * 8 for word in words)
    read_words = select_ops(torch.device("cpu")).read_words
    return total / best_seconds(lambda: [read_words(word) for word in words], repeats)


def storage_words(tensors) -> list[torch.Tensor]:
    """Each distinct storage under `tensors` once, whole, viewed as int64 words (an integer
    sum has no slow path for the bit patterns that bf16 pairs make as floats)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage
    return [torch.empty(0, dtype=torch.int64).set_(storage, 0, (storage.nbytes() // 8,))
            for storage in storages.values()]
