"""The C++ CPU kernels (kernels/csrc) behind the ops' Python signatures."""

import torch

from kernels import cpu_extension


def load() -> None:
    """Build or load the extension and give its ops the shape functions torch.compile needs."""
    cpu_extension.load()
    _register_fakes()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention; reads K/V in place."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()  # the kernel takes rows of a fused projection as they are
    if out is None:
        out = query.new_empty(query.shape)
    torch.ops.kvscope.paged_attention(
        query, key_cache, value_cache, block_tables.to(torch.int32), seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32), scale, out)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.reference.store_kv."""
    torch.ops.kvscope.store_kv(key.to(key_cache.dtype), value.to(value_cache.dtype),
                               key_cache, value_cache, slot_mapping.to(torch.int64))


_fakes_registered = False


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    # Both ops only write into tensors they are given: nothing to allocate when tracing.
    torch.library.register_fake("kvscope::paged_attention")(lambda *args: None)
    torch.library.register_fake("kvscope::store_kv")(lambda *args: None)
    _fakes_registered = True
