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
import ctypes
import math
import mmap
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_COLLAPSE = 25  # MADV_COLLAPSE (Linux 6.1): back a range with huge pages now, data kept
_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14): fault a range in now, data kept


def empty(shape: tuple[int, ...], dtype: torch.dtype, *, background: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the kernel is asked to make huge (when it is big
    enough to hold one). It lives in a fresh anonymous mapping: memory the allocator reuses is
    already backed by small pages, which advice no longer changes.

    Its pages are made resident here, or with `background` by a thread that wait_resident()
    joins (the engine does before its next step). Left to fault in on first write, a KV
    cache pays for each huge page as decoding first reaches it, inside prefills and decode
    steps, for the whole first pass through the pool (docs/performance-history.md,
    '`store_kv` was page faults'). Resident before serving, the cost moves to start-up, and
    memory the plan counted is held from the start rather than found missing mid-serving. In
    the background it overlaps what comes before the first step (the dashboard's start, a
    person's first message): seconds of a 1.5 GiB pool's start on the VMs measured
    (docs/performance-history.md, "The KV pool made resident in the background")."""
    nbytes = math.prod(shape) * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Whole huge pages, the last one partly used: were the tail left on small pages, a 3.4 MiB
    # weight would stream 40 % of itself through 4 KiB pages. One huge page more, so the
    # tensor can start on a 2 MiB boundary. The tensor keeps the mapping alive; freeing it
    # unmaps it. Private: a shared anonymous mapping is shmem, which THP's usual setting
    # leaves alone.
    huge_bytes = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, huge_bytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    # A refusal (THP disabled) leaves ordinary pages, which is still correct.
    with contextlib.suppress(OSError):
        mapping.madvise(_ADVICE, offset, huge_bytes)
    tensor = raw[offset:offset + nbytes]
    if background:
        thread = threading.Thread(target=_populate, args=(mapping, raw.data_ptr() + offset, huge_bytes),
                                  name="kvscope-populate", daemon=True)
        thread.start()
        _populating.append(thread)
    elif not _populate(mapping, raw.data_ptr() + offset, huge_bytes):
        tensor.zero_()  # a kernel before 5.14: writing the zeros faults the pages in
    return tensor.view(dtype).view(shape)


_populating: list[threading.Thread] = []


def _populate(mapping: mmap.mmap, address: int, length: int) -> bool:
    """Fault `length` bytes from `address` in for writing, keeping their (zero) data; False
    where the kernel cannot (before Linux 5.14), and the pages then fault in on first write.
    `mapping` owns the range: an argument of this call, it stays mapped while this runs."""
    return _madvise(address, length, _POPULATE_WRITE)


def _madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) through libc, which releases the GIL while the kernel works (populating a
    pool takes seconds; mmap.madvise would hold every other thread for them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, advice) == 0


def wait_resident() -> None:
    """Wait until the tensors empty() is populating in the background are resident."""
    while _populating:
        _populating.pop().join()


def move_module(module: torch.nn.Module, leave: list[torch.Tensor] = ()) -> None:
    """Re-home the module's CPU parameters and buffers (tied ones once: they are the same
    tensor) side by side in one huge-page region, in the module's order, which is the order a
    forward streams them in. One region rather than one per tensor: a tensor's last partial
    huge page would otherwise be wasted, and a packed int4 layer is well under one page.
    Tensors in `leave` stay where they are (memory another library owns and reads)."""
    seen: set[int] = {id(tensor) for tensor in leave}
    tensors = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        seen.add(id(tensor))
        tensors.append(tensor)
    _share_region(tensors)


_ALIGNMENT = 64  # a cache line: every tensor in a shared region starts on one


def _share_region(tensors: list[torch.Tensor]) -> None:
    """Copy the tensors into one huge-page region, side by side, if together they fill at
    least one huge page (else they stay where they are)."""
    starts, total = [], 0
    for tensor in tensors:
        starts.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGNMENT) * _ALIGNMENT
    if total < HUGE_PAGE_BYTES:
        return
    region = empty((total,), torch.uint8)
    for tensor, start in zip(tensors, starts):
        moved = region[start:start + tensor.numel() * tensor.element_size()]
        moved = moved.view(tensor.dtype).view(tuple(tensor.shape))
        moved.copy_(tensor.data)
        tensor.data = moved


def collapse(tensor: torch.Tensor) -> None:
    """Ask the kernel to back the whole huge pages inside a tensor's memory with huge pages
    now, keeping the data: for memory another library allocated and filled (oneDNN's
    prepacked weights), which advice before the first touch could not reach. A kernel
    without MADV_COLLAPSE, or THP off, leaves it as it is."""
    if _ADVICE is None:
        return
    start = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end > start:
        _madvise(start, end - start, _COLLAPSE)
