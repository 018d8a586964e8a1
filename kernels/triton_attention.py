"""Triton paged attention: causal varlen attention that reads K/V through block tables.

One launch covers a ragged batch of cold prefills, prefills over cached context, prefill
chunks and decodes. The grid is (query tiles over all sequences, kv heads, kv splits):

- A program owns BLOCK_Q new tokens of one sequence times all query heads that share one
  kv head (GQA), packed into BLOCK_M = BLOCK_Q * QUERIES_PER_KV_PAD rows, so each K/V
  tile is loaded once per kv head and used by the whole head group.
- It walks the sequence's keys in tiles of BLOCK_N positions. A tile's keys are located
  position by position (position -> block table entry -> physical block and offset), so
  the tile size is independent of the cache block size, scattered blocks are gathered
  inside the kernel, and a partly filled last block is masked by the sequence length.
- Softmax is online: a running max and running sum per row, rescaled tile by tile
  (base-2 exponentials; the scale is folded into log2(e)).
- Sequence i owns query tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1); a
  binary search over query_start_loc maps a program to its sequence, so the grid size
  (num_tokens // BLOCK_Q + num_seqs) needs nothing from the device and no host sync.
- A sliding window (sliding_window > 0) starts a tile's keys at its first token's window
  and masks each row's keys before its own; soft-capping (SOFT_CAP) squashes the scores
  through cap * tanh(score / cap) before the softmax.
- Attention sinks (SINKS: one logit per query head, gpt-oss) join each row's softmax
  denominator once, where the row is normalised: after its last key tile, or in the merge.
- Decode batches too small to fill the GPU split each sequence's keys over several
  programs (flash-decoding); a second kernel merges the partial (acc, max, sum) triples.
"""

import functools
import os
import sys

import torch
import triton
import triton.language as tl

from kvscope.kernels import kv_quant
from kvscope.kernels import triton_kv_codes as kv_codes
from kvscope.kernels.kernel_ops import AttentionCall, paged_attention_op

# @triton.jit picks the interpreter at decoration time, so this is fixed at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include tile_index (first tiles strictly increase)."""
    low: tl.int32 = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_tile <= tile_index:
            low = middle + 1
        else:
            high = middle
    return low - 1


if type(_find_sequence) is not type(tl.cdiv):
    raise RuntimeError(
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now, but triton.language was "
        "imported (by torch, transformers, ...) under another setting; set it before "
        "anything imports triton")


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; PRECISION only matters for fp32 operands."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b.to(a.dtype), input_precision=PRECISION)


# The block size is a runtime shift (it is a power of two), not a constexpr: one compiled
# kernel serves every block size.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "block_size_log2", "sliding_window"])
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr,
    scale, num_seqs, num_splits, block_size_log2, sliding_window, soft_cap,
    stride_query_token, stride_query_head,
    stride_key_block, stride_key_slot, stride_key_head,
    stride_value_block, stride_value_slot, stride_value_head,
    stride_block_table,
    stride_out_token, stride_out_head,
    stride_partial_split, stride_partial_token,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
    CODES: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    query_tile = tile_index - (query_start // BLOCK_Q + seq)
    if query_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row r is new token r // QUERIES_PER_KV_PAD (within this tile) for query head
    # kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV_PAD.
    rows = tl.arange(0, BLOCK_M)
    token = query_tile * BLOCK_Q + rows // QUERIES_PER_KV_PAD
    head_in_group = rows % QUERIES_PER_KV_PAD
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (token < query_len) & (head_in_group < QUERIES_PER_KV)
    query_pos = context_len + token
    flat_token = (query_start + token).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM

    query = tl.load(
        query_ptr + flat_token[:, None] * stride_query_token
        + head[:, None] * stride_query_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )

    # Keys this tile can see end at its last token's position and, with a window, start at
    # its first token's window; a split takes an equal share of those key tiles.
    kv_end = tl.minimum(seq_len, context_len + (query_tile + 1) * BLOCK_Q)
    kv_first = 0
    if sliding_window > 0:
        kv_first = tl.maximum(0, context_len + query_tile * BLOCK_Q - sliding_window + 1)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_first, BLOCK_N), num_splits)
    kv_start = kv_first + split * tiles_per_split * BLOCK_N
    kv_stop = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table

    for tile_start in range(kv_start, kv_stop, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_stop
        physical_block = tl.load(block_table + (pos >> block_size_log2), mask=pos_valid,
                                 other=0).to(tl.int64)
        slot_in_block = pos & ((1 << block_size_log2) - 1)
        kv_mask = pos_valid[None, :] & dim_valid[:, None]

        key = kv_codes.load(  # [HEAD_PAD, BLOCK_N]: already transposed for q @ k
            key_cache_ptr, (physical_block * stride_key_block + slot_in_block * stride_key_slot
                            + kv_head * stride_key_head)[None, :],
            dims[:, None], kv_mask, pos_valid[None, :], query.dtype,
            HEAD_DIM, CODES, MANTISSA, BIAS)
        scores = _dot(query, key, UPCAST_DOT, DOT_PRECISION)
        if SOFT_CAP:
            # cap * tanh(s / cap), tanh written with exp (1 - 2 / (e^2x + 1): exact at +-inf)
            capped = scores * (scale / soft_cap)
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * 1.4426950408889634
        else:
            scores = scores * qk_scale
        visible = pos_valid[None, :] & (pos[None, :] <= query_pos[:, None])
        if sliding_window > 0:
            visible = visible & (pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # A row that has seen no key yet keeps max -inf; shift it by 0 to avoid inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, 1)

        value = kv_codes.load(  # [BLOCK_N, HEAD_PAD]
            value_cache_ptr, (physical_block * stride_value_block
                              + slot_in_block * stride_value_slot
                              + kv_head * stride_value_head)[:, None],
            dims[None, :], pos_valid[:, None] & dim_valid[None, :], pos_valid[:, None],
            query.dtype, HEAD_DIM, CODES, MANTISSA, BIAS)
        acc = acc * rescale[:, None] + _dot(probs.to(value.dtype), value, UPCAST_DOT,
                                              DOT_PRECISION)
        running_max = new_max

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT_KV:
        partial_row = split * stride_partial_split + flat_token * stride_partial_token + head
        tl.store(partial_max_ptr + partial_row, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, running_sum, mask=row_valid)
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=store_mask)
    else:
        if SINKS:  # the sink's exponential in the rows' base-2 units, as their scores'
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            running_sum += tl.exp2(sink - running_max)
        # Padding rows never saw a key; keep their (unstored) division finite.
        denominator = tl.where(running_sum == 0.0, 1.0, running_sum)
        result = acc / denominator[:, None]
        tl.store(
            out_ptr + flat_token[:, None] * stride_out_token
            + head[:, None] * stride_out_head + dims[None, :],
            result.to(out_ptr.dtype.element_ty), mask=store_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, sinks_ptr,
    num_splits, num_heads,
    stride_partial_split, stride_partial_token, stride_out_token, stride_out_head,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    split_valid = splits < num_splits
    partial_row = splits * stride_partial_split + token * stride_partial_token + head

    split_max = tl.load(partial_max_ptr + partial_row, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + partial_row, mask=split_valid, other=0.0)
    overall_max = tl.max(split_max, 0)
    shift = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    weight = tl.where(split_max == float("-inf"), 0.0, tl.exp2(split_max - shift))
    denominator = tl.sum(split_sum * weight, 0)
    if SINKS:
        denominator += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - shift)
    denominator = tl.where(denominator == 0.0, 1.0, denominator)

    # A split that saw no key may never have been written: skip it rather than read it.
    split_acc = tl.load(partial_out_ptr + partial_row[:, None] * HEAD_PAD + dims[None, :],
                        mask=(weight > 0.0)[:, None], other=0.0)
    result = tl.sum(split_acc * weight[:, None], 0) / denominator
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims,
             result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.cache
def _num_programs_to_fill(device: torch.device) -> int:
    """About two waves of programs on this GPU; 1 where there is no GPU to fill."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _fp32_dot_precision(device: torch.device) -> str:
    """How fp32 operands multiply: three TF32 tensor-core products (about fp32 accuracy,
    several times faster to run and to compile than FMA) where NVIDIA GPUs have them."""
    nvidia = device.type == "cuda" and torch.version.hip is None and not INTERPRETED
    return "tf32x3" if nvidia and torch.cuda.get_device_capability(device) >= (8, 0) else "ieee"


def _choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int,
                       max_kv_len: int, block_n: int, device: torch.device) -> int:
    """Split keys across programs only for decode batches too small to fill the GPU."""
    if num_tokens != num_seqs:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(_num_programs_to_fill(device), programs)
    # Each split should still stream a few key tiles, or merging costs more than it saves.
    return max(1, min(wanted, triton.cdiv(max_kv_len, block_n) // 4, 64))


@paged_attention_op
def paged_attention(call: AttentionCall) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged K/V.

    Same contract as kernels.reference.paged_attention.
    """
    return attend(call)


def attend(call: AttentionCall, block_m: int | None = None, block_n: int | None = None,
           num_kv_splits: int | None = None) -> torch.Tensor:
    """paged_attention with block_m / block_n (query rows and keys per tile) and
    num_kv_splits given rather than chosen by the heuristics (tests use them)."""
    num_tokens, num_heads, head_dim = call.query.shape
    key_cache, value_cache = call.key_cache, call.value_cache
    _, block_size, num_kv_heads, _ = key_cache.shape
    if (kv_quant.head_dim_of(key_cache) != head_dim or value_cache.shape != key_cache.shape
            or value_cache.dtype != key_cache.dtype):
        raise ValueError(
            f"query head_dim={head_dim}, key_cache {tuple(key_cache.shape)} and value_cache "
            f"{tuple(value_cache.shape)} must agree")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous in head_dim")
    out = torch.empty_like(call.query) if call.out is None else call.out
    num_seqs = call.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    call.check_block_tables()  # the kernel would read a bad entry as an address
    query = call.query if call.query.stride(-1) == 1 else call.query.contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    # The binary search keeps loop-carried int32 values; int64 metadata would not match.
    block_tables = call.block_tables.to(torch.int32)
    seq_lens = call.seq_lens.to(torch.int32)
    query_start_loc = call.query_start_loc.to(torch.int32)

    queries_per_kv = num_heads // num_kv_heads
    queries_per_kv_pad = triton.next_power_of_2(queries_per_kv)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # Tiles shrink with the row size so the query tile and K/V tiles fit in shared memory
    # (fp32 or head_dim 256 halve them); a decode-only batch has one row per sequence.
    row_bytes = head_pad * query.element_size()
    if block_m is None:
        block_m = 16 if num_tokens == num_seqs else min(64, max(16, 16384 // row_bytes))
    block_m = max(block_m, queries_per_kv_pad, 16)
    block_q = block_m // queries_per_kv_pad
    if block_n is None:
        block_n = min(64, max(16, 16384 // row_bytes))
    if num_kv_splits is None:
        num_kv_splits = _choose_num_splits(
            num_tokens, num_seqs, num_kv_heads,
            min(block_tables.shape[1] * block_size, call.sliding_window or sys.maxsize), block_n,
            query.device)
    split_kv = num_kv_splits > 1

    if split_kv:
        partial_out = torch.empty(num_kv_splits, num_tokens, num_heads, head_pad,
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.full((num_kv_splits, num_tokens, num_heads), float("-inf"),
                                 dtype=torch.float32, device=query.device)
        partial_sum = torch.zeros_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = target  # unused

    key_target, codes = kv_codes.code_format(key_cache)
    value_target, _ = kv_codes.code_format(value_cache)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    sinks = call.sinks
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks {tuple(sinks.shape)} {sinks.dtype} must be float32 [{num_heads}]"
                         " (one per query head)")
    sinks_arg = query if sinks is None else sinks.contiguous()  # unused without sinks
    _paged_attention_kernel[grid](
        query, key_target, value_target, block_tables, seq_lens, query_start_loc,
        target, partial_out, partial_max, partial_sum, sinks_arg,
        call.scale, num_seqs, num_kv_splits, block_size.bit_length() - 1,
        call.sliding_window or 0, call.soft_cap or 1.0,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        target.stride(0), target.stride(1),
        num_tokens * num_heads if split_kv else 0, num_heads,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        QUERIES_PER_KV=queries_per_kv, QUERIES_PER_KV_PAD=queries_per_kv_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_KV=split_kv,
        # The interpreter (triton 3.x) multiplies bf16 dot operands as raw bits, and fp16
        # ones without BLAS; fp32 products of half inputs are exact, so this is only faster.
        UPCAST_DOT=INTERPRETED and query.dtype != torch.float32,
        DOT_PRECISION=_fp32_dot_precision(query.device), SOFT_CAP=bool(call.soft_cap),
        SINKS=sinks is not None, **codes,
    )
    if split_kv:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial_out, partial_max, partial_sum, target, sinks_arg,
            num_kv_splits, num_heads,
            num_tokens * num_heads, num_heads, target.stride(0), target.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits), SINKS=sinks is not None,
        )
    if target is not out:
        out.copy_(target)
    return out
