"""CPU tensors on transparent huge pages (2 MiB) for what decoding streams every step.

A decode step reads every weight and much of the KV cache from memory. On 4 KiB pages a
core's stream prefetchers stop at every page boundary, and a paged KV cache misses the TLB on
almost every block it visits; on 2 MiB pages the same loops read measurably faster
(`bench/roofline.py` reports both). Linux backs a range with huge pages only when asked with
madvise(MADV_HUGEPAGE) in its common THP mode ("madvise"), and only if asked before the pages
are first touched, so the big tensors are allocated here, advised, and only then filled.
Where THP is off or the platform is not Linux, these are ordinary tensors.
"""

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages the kernel is asked to make huge (when it is
    big enough to hold one); the caller fills it."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if _libc is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    # Over-allocate by one huge page and start the tensor on a 2 MiB boundary, so every page
    # of it can be a huge page.
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[offset:offset + nbytes]
    advised = nbytes - nbytes % HUGE_PAGE_BYTES
    # A refusal (THP disabled: EINVAL) leaves ordinary pages, which is still correct.
    _libc.madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(advised), _MADV_HUGEPAGE)
    return region.view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def move_module(module: torch.nn.Module) -> None:
    """Re-home the module's CPU parameters and buffers of at least one huge page (tied ones
    once: they are the same tensor)."""
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if (id(tensor) in seen or tensor.device.type != "cpu"
                or tensor.numel() * tensor.element_size() < HUGE_PAGE_BYTES):
            continue
        seen.add(id(tensor))
        moved = empty(tuple(tensor.shape), tensor.dtype)
        moved.copy_(tensor.data)
        tensor.data = moved
