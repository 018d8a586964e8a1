"""GGUF's block formats in plain torch: which ones kvscope keeps packed, their sizes, and
their de-quantization on any device (the torch and Triton backends' path; the oracle of the
C++ kernels is the gguf package's own numpy de-quantization, which this one equals bit for
bit: tests/test_gguf_blocks.py).

The layouts are ggml's (ggml-common.h); kernels/csrc/quantized/kquants.cpp describes them.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
# The block types the C++ kernels (gguf_linear) and `dequantize` read.
PACKED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


# Where each type keeps its float16 scales (d, and m / dmin), and the largest |q|-times-
# sub-scale it multiplies them by, so random blocks give weights within about +-RANDOM_SIZE.
FP16_FIELDS = {Q.Q4_0: {0: 8}, Q.Q4_1: {0: 8, 2: -1}, Q.Q5_0: {0: 16}, Q.Q5_1: {0: 16, 2: -1},
               Q.Q8_0: {0: 128}, Q.Q4_K: {0: 63 * 15 / 2, 2: 63}, Q.Q5_K: {0: 63 * 31 / 2, 2: 63},
               Q.Q6_K: {208: 32 * 127}}
RANDOM_SIZE = 0.2


def random_blocks(kind: GGMLQuantizationType, rows: int, in_features: int,
                  rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random valid blocks, for tests and benches (values do not
    change the kernels' work): random quants and sub-scales (every bit pattern is valid)
    with finite float16 scales of about RANDOM_SIZE over their range."""
    weights, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, in_features // weights, size), dtype=np.uint8)
    for at, span in FP16_FIELDS[kind].items():
        scale = (RANDOM_SIZE / span * rng.uniform(0.5, 1.5, blocks.shape[:2])).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def row_bytes(kind: GGMLQuantizationType, in_features: int) -> int:
    weights, size = GGML_QUANT_SIZES[kind]
    return in_features // weights * size


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as fp32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 2n]: the low nibbles of all n bytes, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bytes [..., n] -> [..., count, n]: bit b of every byte in row b."""
    shifts = torch.arange(count, device=qh.device, dtype=torch.uint8).view(count, 1)
    return (qh.unsqueeze(-2) >> shifts) & 1


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (uint8)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mins


# The offset of a 32-weight type without a min, as a multiple of its d (w = q * d + that * d
# for its unsigned quants q; kernels/csrc/quantized/kquants_blocks.h's block32_offset_per_d).
OFFSET_PER_D = {Q.Q4_0: -8, Q.Q5_0: -16, Q.Q8_0: -128}


def block32_quants(blocks: torch.Tensor, kind: GGMLQuantizationType
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 32-weight type's blocks [rows, blocks, bytes] as w = q * d + offset, each term
    exact: the unsigned quants [rows, blocks, 32] (uint8, x's order; Q8_0's int8 + 128), d
    and the offset [rows, blocks] (fp32; Q4_1's and Q5_1's m, Q4_0's -8 d, Q5_0's -16 d,
    Q8_0's -128 d)."""
    rows = blocks.shape[0]
    d = _halves(blocks, 0).squeeze(-1)
    if kind == Q.Q8_0:
        q = (blocks[..., 2:].contiguous().view(torch.int8).int() + 128).to(torch.uint8)
    else:
        q = _nibbles(blocks[..., -16:])
    if kind in (Q.Q5_0, Q.Q5_1):  # 32 5th bits, little-endian, weight j's at bit j
        at = 2 if kind == Q.Q5_0 else 4
        q = q | (_bits(blocks[..., at:at + 4], 8).transpose(-1, -2).reshape(rows, -1, 32) << 4)
    if kind in OFFSET_PER_D:
        return q, d, OFFSET_PER_D[kind] * d
    return q, d, _halves(blocks, 2).squeeze(-1)


def k4_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K blocks [rows, super-blocks, bytes] -> their low 4 bits [rows, super-blocks,
    8 sub-blocks, 32]: sub-block j is chunk j // 2 of the last 128 bytes, low nibbles if even."""
    rows = blocks.shape[0]
    return _nibbles(blocks[..., -128:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 8, 32)


def k5_bits(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [rows, super-blocks, 176] -> their 5th bits [rows, super-blocks, 8
    sub-blocks, 32]: sub-block j's is bit j of the 32 bytes after the scales."""
    return _bits(blocks[..., 16:48], 8).reshape(blocks.shape[0], -1, 8, 32)


def q6_quants(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks [rows, super-blocks, 210] -> their 6-bit quants [rows, super-blocks, 256]
    (uint8 0..63, x's order: the low nibbles of 128 bytes, then 2 bits each of 64) and
    their int8 scales [rows, super-blocks, 16], one per 16 weights."""
    rows = blocks.shape[0]
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(rows, -1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).view(4, 1)
    high = (qh >> shifts) & 3
    return (low | (high << 4)).reshape(rows, -1, 256), blocks[..., 192:208].contiguous().view(torch.int8)


def q6_weights(d: torch.Tensor, sc: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d * sc) * (q - 32) per 16 weights, in ggml's order of operations (fp32): d [rows,
    super-blocks, 1], sc [rows, super-blocks, 16], q [rows, super-blocks, 256]."""
    rows = q.shape[0]
    return ((d * sc.float()).unsqueeze(-1) * (q.float() - 32).view(rows, -1, 16, 16)).reshape(
        rows, -1, 256)


def k4_weights(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mins: torch.Tensor,
               q: torch.Tensor) -> torch.Tensor:
    """(d * sc) * q - dmin * m per sub-block, in ggml's order of operations (fp32)."""
    return (d * sc).unsqueeze(-1) * q.float() - (dmin * mins).unsqueeze(-1)


def dequantize(weight: torch.Tensor, kind: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] of blocks -> fp32 [rows, in_features]."""
    weights, size = GGML_QUANT_SIZES[kind]
    rows = weight.shape[0]
    b = weight.reshape(rows, in_features // weights, size)
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        q, d, offset = block32_quants(b, kind)
        w = q.float() * d.unsqueeze(-1) + offset.unsqueeze(-1)
    elif kind in (Q.Q4_K, Q.Q5_K):
        d, dmin = _halves(b, 0), _halves(b, 2)
        sc, mins = (part.float() for part in k_scales(b[..., 4:16]))
        q = k4_nibbles(b)
        if kind == Q.Q5_K:
            q = q | (k5_bits(b) << 4)
        w = k4_weights(d, dmin, sc, mins, q)
    elif kind == Q.Q6_K:
        q, sc = q6_quants(b)
        w = q6_weights(_halves(b, 208), sc, q)
    else:
        raise ValueError(f"GGUF type {kind.name} has no kvscope de-quantization; "
                         f"packed types: {[t.name for t in PACKED_TYPES]}")
    return w.reshape(rows, in_features)
