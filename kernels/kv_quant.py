"""The quantized KV cache's format: what every store_kv writes and every attention reads.

With kv_cache_dtype fp8 (= fp8_e4m3), fp8_e5m2 or int8, a cache row (one token's K or V at
one KV head) is head_dim codes followed by the row's scale, a bf16 in the row's last two
bytes: value = code * scale. The cache tensor keeps the codes' dtype and is
[blocks, block_size, kv_heads, head_dim + 2], so a block holds its scales inline: every
whole-block move (copy-on-write, swap out and in) carries them, and a prefix-cache hit
reads them where they were written.

Why per token and head (docs/performance-history.md, 'The quantized KV cache', has the
figures): a row's keys are written once, by one store, so its scale is exact for it (its
largest value maps to the largest code) and never needs rescaling when later tokens arrive,
which a per-block scale would; per tensor (vLLM's k_scale / v_scale, 1.0 without
calibration) leaves int8 no range to use and fp8 the model's outliers to clip or underflow.
The scale costs 2 bytes per head_dim codes: a 64-dim head stores 66 bytes for bf16's 128
(1.94x the blocks).

The scale is rounded to bf16 before the codes are computed, so de-quantizing is exact:
code * scale is what the kernels read, and the plain-torch quantizer here is the oracle
the C++ and Triton stores are held to bit for bit.
"""

import torch

# kv_cache_dtype -> the codes' dtype (None: the model's own dtype)
CODE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
}
# the largest code magnitude: a row's largest value maps to it
CODE_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
SCALE_ELEMENTS = 2  # one bf16 scale per row, in two 1-byte elements after the codes
# Raise with any change to what a KV cache block's bytes mean (this row format, the
# [2, layers, blocks, block_size, heads, row] pool): a disk tier's blocks written under
# another version are never read (engine/worker/kv_tier.py's fingerprint).
CACHE_LAYOUT_VERSION = 1


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a kv_cache_dtype knob value."""
    return CODE_DTYPES[kv_cache_dtype] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in CODE_MAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: head_dim, plus the scale's for a quantized cache."""
    return head_dim + SCALE_ELEMENTS if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - (SCALE_ELEMENTS if is_quantized(cache.dtype) else 0)


def quantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] values -> [..., head_dim + 2] cache rows of `dtype` (codes, scale)."""
    values = rows.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    # An all-zero row gets scale 1 (its codes are 0 anyway).
    scale = torch.where(amax > 0, amax / CODE_MAX[dtype], 1.0).to(torch.bfloat16)
    scaled = (values / scale.float()).clamp(-CODE_MAX[dtype], CODE_MAX[dtype])
    codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    out = torch.empty((*rows.shape[:-1], rows.shape[-1] + SCALE_ELEMENTS), dtype=dtype,
                      device=rows.device)
    out[..., :-SCALE_ELEMENTS] = codes
    out.view(torch.uint8)[..., -SCALE_ELEMENTS:] = scale.view(torch.uint8)
    return out


def encode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] values as rows of a cache of `dtype`: quantized, or converted."""
    return quantize(rows, dtype) if is_quantized(dtype) else rows.to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """Each quantized cache row's scale, fp32 [...]."""
    raw = rows.view(torch.uint8)[..., -SCALE_ELEMENTS:].contiguous()
    return raw.view(torch.bfloat16).squeeze(-1).float()


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows -> [..., head_dim] values in `dtype` (a plain cache's rows just converted).

    The attention oracle calls this on the rows it gathers for one batch, never on the
    whole cache."""
    if not is_quantized(rows.dtype):
        return rows.to(dtype)
    codes = rows[..., :-SCALE_ELEMENTS].float()
    return (codes * scales(rows).unsqueeze(-1)).to(dtype)
