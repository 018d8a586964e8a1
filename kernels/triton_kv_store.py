"""Triton KV store: write each new token's K/V rows into its paged-cache slot (quantizing
them for a quantized cache: kernels/triton_kv_codes.py)."""

import os

import torch
import triton
import triton.language as tl

from kvscope.kernels import kv_quant
from kvscope.kernels import triton_kv_codes as kv_codes

# @triton.jit picks the interpreter at decoration time, so this is fixed at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_key_cache_block, stride_key_cache_slot, stride_key_cache_head,
    stride_value_cache_block, stride_value_cache_slot, stride_value_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    CODES: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, CODE_MAX: tl.constexpr,
):
    """One program per token: all kv heads of its key and value row."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_mask = heads < NUM_KV_HEADS
    dim_mask = dims < HEAD_DIM
    mask = head_mask[:, None] & dim_mask[None, :]

    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head
                  + dims[None, :], mask=mask, other=0.0)
    kv_codes.store(
        key_cache_ptr, block * stride_key_cache_block + offset * stride_key_cache_slot
        + heads * stride_key_cache_head, dims, key, head_mask, dim_mask,
        HEAD_DIM, CODES, MANTISSA, BIAS, CODE_MAX)
    value = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head
                    + dims[None, :], mask=mask, other=0.0)
    kv_codes.store(
        value_cache_ptr, block * stride_value_cache_block + offset * stride_value_cache_slot
        + heads * stride_value_cache_head, dims, value, head_mask, dim_mask,
        HEAD_DIM, CODES, MANTISSA, BIAS, CODE_MAX)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, kv_heads, head_dim] into slot block * block_size + offset.

    A slot of -1 is skipped. Same contract as kernels.reference.store_kv.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    width = kv_quant.row_width(head_dim, key_cache.dtype)
    if (key_cache.shape[2:] != (num_kv_heads, width) or value_cache.shape != key_cache.shape
            or value_cache.dtype != key_cache.dtype):
        raise ValueError(
            f"key {tuple(key.shape)} does not fit key_cache {tuple(key_cache.shape)} / "
            f"value_cache {tuple(value_cache.shape)}"
            + (" (a quantized cache row holds head_dim codes and a scale)"
               if width != head_dim else ""))
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous in head_dim")
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    key_target, codes = kv_codes.code_format(key_cache)
    value_target, _ = kv_codes.code_format(value_cache)
    _store_kv_kernel[(num_tokens,)](
        key, value, key_target, value_target, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        CODE_MAX=kv_quant.CODE_MAX.get(key_cache.dtype, 0.0), **codes,
    )
