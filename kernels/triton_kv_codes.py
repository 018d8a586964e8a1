"""The quantized KV cache's rows (kernels/kv_quant.py) in Triton: what the Triton store
writes and the Triton attention reads, in place.

A quantized cache reaches the kernels as its bytes (a uint8 view): a row is head_dim codes
and its bf16 scale in the last two bytes. Codes are encoded and decoded with integer
arithmetic on the bits, not with Triton's float8 types, because:
- the float8 e4m3 type exists only on NVIDIA GPUs of compute capability 8.9 and later
  (Triton refuses it elsewhere), so byte arithmetic serves every GPU alike;
- it rounds as torch does (to nearest, ties to even, subnormals included), so the store
  equals kv_quant.quantize bit for bit, on a GPU and in Triton's interpreter (whose float8
  and bf16 casts round differently from a GPU's).
Divisions are div_rn (IEEE-rounded; a GPU's plain fp32 `/` is approximate) for the same
reason.
"""

import torch
import triton
import triton.language as tl

from kvscope.kernels import kv_quant


def code_format(cache: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The tensor a kernel gets for `cache` and the constexprs that describe its rows:
    CODES "plain" (the values themselves), "int8" or "float8" (MANTISSA bits, exponent
    BIAS)."""
    formats = {
        torch.float8_e4m3fn: dict(CODES="float8", MANTISSA=3, BIAS=7),
        torch.float8_e5m2: dict(CODES="float8", MANTISSA=2, BIAS=15),
        torch.int8: dict(CODES="int8", MANTISSA=0, BIAS=0),
    }
    if not kv_quant.is_quantized(cache.dtype):
        return cache, dict(CODES="plain", MANTISSA=0, BIAS=0)
    return cache.view(torch.uint8), formats[cache.dtype]


@triton.jit
def _bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _float(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """Positive finite fp32 x rounded to the nearest bf16 (ties to even), as fp32."""
    bits = _bits(x)
    return _float((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536)


@triton.jit
def _float8_codes(scaled, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """fp32 values within the format's range -> their float8 codes (uint8), rounded to
    nearest, ties to even."""
    magnitude = tl.abs(scaled)
    # Normal codes keep MANTISSA of fp32's 23 mantissa bits: round the bits (a carry moves
    # into the exponent), then rebias the exponent.
    DROP: tl.constexpr = 23 - MANTISSA
    bits = _bits(magnitude)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP
    normal = bits - ((127 - BIAS) << MANTISSA)
    # Below the smallest normal code the step is fixed, 2^(1 - BIAS - MANTISSA): adding a
    # constant whose fp32 ulp is that step rounds to it (IEEE addition rounds to nearest
    # even). The code is the count of steps; one that rounds up to the smallest normal
    # reads 1 << MANTISSA, which is that normal's code too.
    STEP_EXPONENT: tl.constexpr = 1 - BIAS - MANTISSA
    SHIFTER: tl.constexpr = 2.0 ** (STEP_EXPONENT + 23)
    smallest_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    below = tl.minimum(magnitude, smallest_normal)  # (the others' counts would overflow)
    steps = ((below + SHIFTER) - SHIFTER) * (2.0 ** -STEP_EXPONENT)
    codes = tl.where(magnitude < smallest_normal, steps.to(tl.int32), normal)
    sign = (_bits(scaled) >> 24) & 0x80  # -0.0 keeps its sign, as torch's cast does
    return (codes | sign).to(tl.uint8)


@triton.jit
def _decode(codes, CODES: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """uint8 codes -> their values, fp32 (exact)."""
    if CODES == "int8":
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    bits = codes.to(tl.int32)
    exponent = (bits >> MANTISSA) & ((1 << (7 - MANTISSA)) - 1)
    mantissa = bits & ((1 << MANTISSA) - 1)
    normal = _float(((exponent + 127 - BIAS) << 23) | (mantissa << (23 - MANTISSA)))
    subnormal = mantissa.to(tl.float32) * (2.0 ** (1 - BIAS - MANTISSA))
    magnitude = tl.where(exponent == 0, subnormal, normal)
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def load(cache_ptr, row_offsets, dim_offsets, mask, row_mask, dtype: tl.constexpr,
         HEAD_DIM: tl.constexpr, CODES: tl.constexpr, MANTISSA: tl.constexpr,
         BIAS: tl.constexpr):
    """Cache values at row_offsets + dim_offsets (broadcast: either may be the tile's rows)
    as `dtype`: a quantized row's codes times its scale, de-quantized here in registers.
    Masked elements read 0."""
    offsets = row_offsets + dim_offsets
    if CODES == "plain":
        return tl.load(cache_ptr + offsets, mask=mask, other=0.0).to(dtype)
    codes = tl.load(cache_ptr + offsets, mask=mask, other=0)
    low = tl.load(cache_ptr + row_offsets + HEAD_DIM, mask=row_mask, other=0).to(tl.int32)
    high = tl.load(cache_ptr + row_offsets + HEAD_DIM + 1, mask=row_mask, other=0).to(tl.int32)
    scale = _float((high << 24) | (low << 16))
    return (_decode(codes, CODES, MANTISSA, BIAS) * scale).to(dtype)


@triton.jit
def store(cache_ptr, row_offsets, dims, rows, row_mask, dim_mask, HEAD_DIM: tl.constexpr,
          CODES: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
          CODE_MAX: tl.constexpr):
    """Write rows [R, D] (masked elements 0) at row_offsets [R]: converted to the cache's
    dtype, or quantized as kv_quant.quantize does (scale = the row's largest magnitude /
    CODE_MAX, the largest code, rounded to bf16; codes = values / scale, rounded)."""
    mask = row_mask[:, None] & dim_mask[None, :]
    offsets = row_offsets[:, None] + dims[None, :]
    if CODES == "plain":
        tl.store(cache_ptr + offsets, rows.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        values = rows.to(tl.float32)
        largest = tl.max(tl.abs(values), 1)
        scale = tl.where(largest > 0, _round_to_bf16(tl.math.div_rn(largest, CODE_MAX)), 1.0)
        scaled = tl.math.div_rn(values, scale[:, None])
        clamped = tl.minimum(tl.maximum(scaled, -CODE_MAX), CODE_MAX)
        if CODES == "int8":
            # + 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to an integer, ties to even
            rounded = (clamped + 12582912.0) - 12582912.0
            codes = rounded.to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            codes = _float8_codes(clamped, MANTISSA, BIAS)
        tl.store(cache_ptr + offsets, codes, mask=mask)
        scale_bits = _bits(scale)
        tl.store(cache_ptr + row_offsets + HEAD_DIM, ((scale_bits >> 16) & 0xFF).to(tl.uint8),
                 mask=row_mask)
        tl.store(cache_ptr + row_offsets + HEAD_DIM + 1,
                 ((scale_bits >> 24) & 0xFF).to(tl.uint8), mask=row_mask)
