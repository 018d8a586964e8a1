"""glibc's malloc asked to keep a forward's large activations in its heap.

glibc serves an allocation of 32 MiB or more (the highest its dynamic threshold goes) with
a fresh mmap and unmaps it when it is freed, so every tensor that size is page-faulted and
zeroed by the kernel each time it is made. A prefill chunk's largest activations are that
size and are made once per layer: Qwen3-1.7B's gate_up output at 2,048 rows is 48 MiB, and
oneDNN's GEMM writing it ran markedly slower on an AMX Xeon than with its pages reused, and
so did the whole prefill (measured in docs/performance-history.md, "A prefill's large
activations on fresh pages"). Raised thresholds keep blocks below REUSED_BYTES in the heap,
and a freed block is reused by the next step's tensor of that size.

The limit covers the activations (the largest, a batch's fp32 logits, are ~200 MB at 256
rows of a 200k vocabulary), not the weights: those are loaded before this is set, and the
KV pool is mapped by huge_pages. A thread other than the main one allocates from an arena
whose heaps are at most 64 MiB, so there a larger block is still a fresh mapping.
"""

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

REUSED_BYTES = 256 << 20
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def reuse_large_blocks() -> bool:
    """Raise glibc's mmap threshold to REUSED_BYTES, and its trim threshold (the free memory
    at the heap's top it keeps rather than returns) to twice that, as glibc's own dynamic
    rule pairs them. False, changing nothing, where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    reused = bool(libc.mallopt(_M_MMAP_THRESHOLD, REUSED_BYTES)
                  and libc.mallopt(_M_TRIM_THRESHOLD, 2 * REUSED_BYTES))
    if reused:
        logger.info("allocations under %d MiB reuse glibc's heap (mallopt)", REUSED_BYTES >> 20)
    return reused
