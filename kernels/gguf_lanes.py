"""Lanes: the C++ kernels' own layouts of GGUF blocks, and Int4Linear's int4 layout they
build on, in plain torch (kernels/csrc/quantized/common.h describes both).

Where the kernels stream a GGUF type faster in lanes (PackedLinearKernels.gguf_repacked_type),
the runner repacks its layers once at load (quantized.py's GgufLinear.repack): the same
weights, bit for bit, as int4 chunks in the wide layout below (5-bit types with their 5th bits
as masks, Q6_K with its top bit pairs, Q8_0 as bytes), each row's scales after its quants.
"""

import torch
import torch.nn.functional as F

from kvscope.kernels import gguf_blocks

INT4_CHUNK = 32  # int4 weights per 16 packed bytes (GGUF's Q4 nibble order)
INT4_WIDE_BLOCK = 16  # chunks per wide block of the kernels' layout (see int4_wide_blocks)


def int4_wide_blocks(packed: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rows of GGUF-order int4 chunks (16 bytes each) in the kernels' layout, or back with
    `inverse`: each run of INT4_WIDE_BLOCK chunks is stored as [t 0..3][chunk][4 bytes], so
    one 64-byte load holds bytes 4t..4t+3 of all 16 chunks and every chunk's dot sums in its
    own int32 lane of a vpdpbusd (kernels/csrc/quantized/vnni.h); the chunks after the
    last whole block keep GGUF's order."""
    rows, width = packed.shape
    wide = width // (INT4_WIDE_BLOCK * INT4_CHUNK // 2) * (INT4_WIDE_BLOCK * INT4_CHUNK // 2)
    blocks = packed[:, :wide].reshape(rows, -1, INT4_WIDE_BLOCK, 4, 4)
    if inverse:
        blocks = blocks.view(rows, -1, 4, INT4_WIDE_BLOCK, 4)
    out = packed.clone()
    out[:, :wide] = blocks.transpose(2, 3).reshape(rows, wide)
    return out


# kvscope's own codes for rows of a GGUF type repacked into lanes, by the type they hold:
# 100 + its ggml type id (ggml's stay below 100).
Q = gguf_blocks.Q
LANES = {kind: 100 + int(kind)
         for kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
SUPER_BLOCK = 256  # weights per k-quant super-block (8 sub-blocks of 32)


def lanes_bits(kind: gguf_blocks.GGMLQuantizationType) -> int:
    return {Q.Q8_0: 8, Q.Q6_K: 6, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5}.get(kind, 4)


def _block32_lanes_bytes(q: torch.Tensor) -> torch.Tensor:
    """8-bit quants [rows, chunks, 32] (uint8) in the kernels' order (common.h): each wide
    block's 16 chunks as 8 loads of 64 bytes, load 2t + h holding bytes 16h + 4t..+3 of
    every chunk in its lane; after them, per quad of chunks, their first 16 bytes, then
    their last 16."""
    rows, chunks = q.shape[:2]
    wide = chunks // INT4_WIDE_BLOCK * INT4_WIDE_BLOCK
    parts = [q[:, :wide].reshape(rows, -1, INT4_WIDE_BLOCK, 2, 4, 4).permute(0, 1, 4, 3, 2, 5)
             .reshape(rows, -1)]
    for first in range(wide, chunks, 4):
        parts.append(q[:, first:first + 4].reshape(rows, -1, 2, 16).transpose(1, 2).reshape(rows, -1))
    return torch.cat(parts, dim=1)


def _block32_lanes_quants(weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """The inverse of _block32_lanes_bytes: [rows, chunks * 32] -> [rows, chunks, 32]."""
    rows = weight.shape[0]
    wide = chunks // INT4_WIDE_BLOCK * INT4_WIDE_BLOCK
    parts = [weight[:, :wide * 32].reshape(rows, -1, 4, 2, INT4_WIDE_BLOCK, 4)
             .permute(0, 1, 4, 3, 2, 5).reshape(rows, wide, 32)]
    for first in range(wide, chunks, 4):
        count = min(4, chunks - first)
        quad = weight[:, first * 32:(first + count) * 32].reshape(rows, 2, count, 16)
        parts.append(quad.transpose(1, 2).reshape(rows, count, 32))
    return torch.cat(parts, dim=1)


def _lanes_quants(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Quants [rows, chunks, 32] (uint8, x's order) -> a row's quant bytes (common.h)."""
    rows = q.shape[0]
    if bits == 8:
        return _block32_lanes_bytes(q)
    half = INT4_CHUNK // 2
    parts = [int4_wide_blocks(((q[..., :half] & 15) | ((q[..., half:] & 15) << 4)).reshape(rows, -1))]
    if bits == 5:
        # Each chunk byte's two 5th bits, moved as its nibbles are, then packed per load.
        pairs = int4_wide_blocks(((q[..., :half] >> 4) | ((q[..., half:] >> 4) << 1)).reshape(
            rows, -1))
        pairs = F.pad(pairs, (0, -pairs.shape[1] % 64)).view(rows, -1, 64)
        planes = torch.stack([pairs & 1, pairs >> 1], dim=-2).view(rows, -1, 2, 8, 8)
        weights = 1 << torch.arange(8, dtype=torch.int32)
        parts.append((planes.int() * weights).sum(-1).to(torch.uint8).reshape(rows, -1))
    if bits == 6:
        # Each chunk byte's two top bit pairs (its low nibble's weight's in bits 0-1, its
        # high one's in 2-3), moved as its nibbles are; loads 2u and 2u + 1 share 64 bytes.
        pairs = int4_wide_blocks(((q[..., :half] >> 4) | ((q[..., half:] >> 4) << 2)).reshape(
            rows, -1)).view(rows, -1, 2, 64)
        parts.append((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, -1))
    return torch.cat(parts, dim=1)


def _quants_of_lanes(weight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The inverse of _lanes_quants: [rows, quant bytes] -> [rows, chunks, 32] (uint8)."""
    rows, chunks = weight.shape[0], in_features // INT4_CHUNK
    if bits == 8:
        return _block32_lanes_quants(weight, chunks)
    nibbles = int4_wide_blocks(weight[:, :in_features // 2].contiguous(), inverse=True)
    nibbles = nibbles.view(rows, chunks, 16)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    if bits == 5:
        fifth = weight[:, in_features // 2:_quant_bytes(bits, in_features)]
        planes = ((fifth.reshape(rows, -1, 2, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1)
        planes = planes.reshape(rows, -1, 2, 64)
        pairs = (planes[:, :, 0] | (planes[:, :, 1] << 1)).reshape(rows, -1)[:, :in_features // 2]
        pairs = int4_wide_blocks(pairs.contiguous(), inverse=True).view(rows, chunks, 16)
        q = q | (torch.cat([pairs & 1, pairs >> 1], dim=-1) << 4)
    if bits == 6:
        shared = weight[:, in_features // 2:_quant_bytes(bits, in_features)].reshape(rows, -1, 1, 64)
        pairs = torch.cat([shared & 15, shared >> 4], dim=2).reshape(rows, -1)
        pairs = int4_wide_blocks(pairs, inverse=True).view(rows, chunks, 16)
        q = q | (torch.cat([pairs & 3, pairs >> 2], dim=-1) << 4)
    return q


def lanes(blocks: torch.Tensor, kind: gguf_blocks.GGMLQuantizationType,
          in_features: int) -> torch.Tensor:
    """Rows of GGUF blocks (uint8 [rows, row bytes]) of a type in LANES repacked into its
    lanes (kernels/csrc/quantized/common.h), the same weights in the int4 kernels' layout:
    the quants (4 bits as Int4Linear's chunks; 5 bits the same and per 64-byte load of
    them a 64-bit mask of 5th bits for its bytes' low nibbles, one for their high ones; 6
    bits the same and per two loads 64 bytes of top bit pairs; 8 bits as
    _block32_lanes_bytes), then Q4_0..Q8_0's float16 d per 32 weights and Q4_1's and Q5_1's
    float16 m per 32 weights (the others' offsets are gguf_blocks.OFFSET_PER_D times d),
    Q4_K's / Q5_K's 6-bit scales and mins (a byte each) and float16 d and dmin per
    super-block, or Q6_K's int8 scale per 16 weights and float16 d per super-block."""
    rows = blocks.shape[0]
    weights, size = gguf_blocks.GGML_QUANT_SIZES[kind]
    b = blocks.reshape(rows, in_features // weights, size)
    if kind in (Q.Q4_K, Q.Q5_K):
        q = gguf_blocks.k4_nibbles(b)  # [rows, super-blocks, 8 sub-blocks, 32]
        if kind == Q.Q5_K:
            q = q | (gguf_blocks.k5_bits(b) << 4)
        sc, mins = gguf_blocks.k_scales(b[..., 4:16])
        tail = [sc, mins, b[..., 0:2], b[..., 2:4]]
    elif kind == Q.Q6_K:
        q, sc = gguf_blocks.q6_quants(b)
        tail = [sc.view(torch.uint8), b[..., 208:210]]
    else:
        q, d, offset = gguf_blocks.block32_quants(b, kind)
        tail = [d.half().view(torch.uint8)]
        if kind not in gguf_blocks.OFFSET_PER_D:
            tail.append(offset.half().view(torch.uint8))
    quants = _lanes_quants(q.reshape(rows, -1, INT4_CHUNK), lanes_bits(kind))
    return torch.cat([quants, *(part.reshape(rows, -1) for part in tail)], dim=1)


def dequantize_lanes(weight: torch.Tensor, kind: gguf_blocks.GGMLQuantizationType,
                     in_features: int) -> torch.Tensor:
    """Rows of a type's lanes -> fp32 [rows, in_features], equal bit for bit to its
    blocks' de-quantization."""
    rows, chunks = weight.shape[0], in_features // INT4_CHUNK
    bits = lanes_bits(kind)
    q = _quants_of_lanes(weight, bits, in_features)
    rest = weight[:, _quant_bytes(bits, in_features):]
    if kind in (Q.Q4_K, Q.Q5_K):
        blocks = in_features // SUPER_BLOCK
        sc, mins, d, dmin = rest.split([chunks, chunks, 2 * blocks, 2 * blocks], dim=1)

        def per_block(halves: torch.Tensor) -> torch.Tensor:
            return halves.contiguous().view(torch.float16).float().view(rows, blocks, 1)
        w = gguf_blocks.k4_weights(per_block(d), per_block(dmin), sc.float().view(rows, blocks, 8),
                                   mins.float().view(rows, blocks, 8), q.view(rows, blocks, 8, 32))
    elif kind == Q.Q6_K:
        blocks = in_features // SUPER_BLOCK
        sc, d = rest.split([in_features // 16, 2 * blocks], dim=1)
        w = gguf_blocks.q6_weights(d.contiguous().view(torch.float16).float().view(rows, blocks, 1),
                                   sc.contiguous().view(torch.int8).view(rows, blocks, 16),
                                   q.view(rows, blocks, 256))
    else:
        halves = rest.contiguous().view(torch.float16).float().view(rows, -1, chunks, 1)
        scale = halves[:, 0]
        offset = scale * gguf_blocks.OFFSET_PER_D[kind] if kind in gguf_blocks.OFFSET_PER_D else halves[:, 1]
        w = q.float() * scale + offset
    return w.reshape(rows, in_features)


def _quant_bytes(bits: int, in_features: int) -> int:
    """The quants' bytes of a row of lanes (common.h's lanes_quant_bytes): 5th bits come
    16 bytes per 64-byte load of nibbles, a tail's shorter load too."""
    if bits == 8:
        return in_features
    return in_features // 2 + {5: 16 * -(-in_features // 128), 6: in_features // 4}.get(bits, 0)
