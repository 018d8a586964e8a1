"""CPU tensors on transparent huge pages (2 MiB) for what decoding streams every step.

A decode step reads every weight and much of the KV cache from memory. On 4 KiB pages a
core's stream prefetchers stop at every page boundary, and a paged KV cache misses the TLB on
almost every block it visits; on 2 MiB pages the same loops read measurably faster
(`bench/roofline.py` reports both). Linux backs a range with huge pages only when asked with
madvise(MADV_HUGEPAGE) in its common THP mode ("madvise"), and only if asked before the pages
are first touched, so the big tensors are mapped here, advised, and only then filled.
Where THP is off or the platform is not Linux, these are ordinary tensors.
"""

import contextlib
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the kernel is asked to make huge (when it is big
    enough to hold one). It lives in a fresh anonymous mapping: memory the allocator reuses is
    already backed by small pages, which advice no longer changes."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a 2 MiB boundary and every
    # page of it can be huge. The tensor keeps the mapping alive; freeing it unmaps it.
    # Private: a shared anonymous mapping is shmem, which THP's usual setting leaves alone.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    # A refusal (THP disabled) leaves ordinary pages, which is still correct.
    with contextlib.suppress(OSError):
        mapping.madvise(_ADVICE, offset, nbytes - nbytes % HUGE_PAGE_BYTES)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


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
