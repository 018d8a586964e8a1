"""Plain-torch paged attention, KV store and mixture-of-experts experts: the fallback path
and the tests' oracle."""

import itertools

import torch
import torch.nn.functional as F

from kvscope.kernels import kv_quant
from kvscope.kernels.kernel_ops import (
    EXPERT_ACTIVATIONS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    AttentionCall,
    ExpertWeights,
    paged_attention_op,
)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V row into its slot (block * block_size + offset); -1 skips.

    A quantized cache (kernels/kv_quant.py) gets each row's codes and scale."""
    num_kv_heads, width = key_cache.shape[-2:]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    for rows, cache in ((key, key_cache), (value, value_cache)):
        flat, rows = cache.view(-1, num_kv_heads, width), kv_quant.encode(rows, cache.dtype)
        if kv_quant.is_quantized(cache.dtype):  # index_copy_ has no float8 kernel: the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first seq_len K (or V) rows of one sequence, contiguous: [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache.index_select(0, block_table[:num_blocks].long().clamp(min=0))
    return rows.flatten(0, 1)[:seq_len]


@paged_attention_op
def paged_attention(call: AttentionCall) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged K/V.

    The arguments are AttentionCall's (kernel_ops.py); the new tokens of sequence i are its
    last q_len_i positions.
    sliding_window=W: the token at position p sees keys (p - W, p] only (transformers'
    sliding-window mask); block table entries wholly before that may be -1 (the KV
    manager's RELEASED: it freed those blocks) and are never read. soft_cap=c: scores
    become c * tanh(scores / c) before the softmax (Gemma 2's attention-logit soft-capping).
    sinks [num_heads]: each head's softmax runs over its scores and its sink, whose weight
    is then dropped (gpt-oss's attention sinks, as transformers computes them).
    Decodes (one new token) run as padded batches of similar lengths; longer queries run
    one by one.
    The padded batch reads slots past each sequence's length and masks them, so those
    slots must hold finite values (a masked NaN still poisons SDPA): allocate caches with
    zeros. The Triton kernel never reads them.
    A quantized cache's rows are de-quantized as they are gathered, for this batch only.
    """
    call.check_block_tables()
    out = torch.empty_like(call.query) if call.out is None else call.out
    starts = call.query_start_loc.tolist()
    lengths = call.seq_lens.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    for rows in _similar_length_groups(decode_rows, lengths):
        _decode_batch(call, starts, rows, out)
    for i, query_len in enumerate(query_lens):
        if query_len > 1:
            start, seq_len = starts[i], lengths[i]
            out[start:start + query_len] = _attend_one(
                call.query[start:start + query_len],
                gather_kv(call.key_cache, call.block_tables[i], seq_len),
                gather_kv(call.value_cache, call.block_tables[i], seq_len),
                call.scale, call.sliding_window, call.soft_cap, call.sinks,
            )
    return out


def _attend_one(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
    sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: query [q, heads, dim] are the last q positions of key/value [s, kv, dim]."""
    query_len, seq_len = query.shape[0], key.shape[0]
    if query_len == seq_len and not sliding_window and not soft_cap and sinks is None:
        mask = None
    else:
        # Query i sits at position seq_len - query_len + i and sees keys up to there.
        device = query.device
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        mask = key_pos <= query_pos
        if sliding_window:
            mask &= key_pos > query_pos - sliding_window
    result = _softmax_attention(
        query.transpose(0, 1), kv_quant.dequantize(key.transpose(0, 1), query.dtype),
        kv_quant.dequantize(value.transpose(0, 1), query.dtype), mask, scale, soft_cap, sinks)
    return result.transpose(0, 1)


def _softmax_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    scale: float, soft_cap: float | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked [, sink]) v over [..., heads, len, dim]
    tensors; mask None means causal over equal lengths."""
    if not soft_cap and sinks is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=query.shape[-3] != key.shape[-3])
    group = query.shape[-3] // key.shape[-3]
    key = key.repeat_interleave(group, dim=-3)
    value = value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1).to(value.dtype), value)
    # The sink is one more column of scores whose weight is dropped after the softmax.
    sink_column = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(weights.to(value.dtype), value)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, blocks] tables -> K (or V) as [batch, kv_heads, blocks * block_size, dim].

    index_select on the flattened table, not cache[tables]: on the CPU advanced indexing
    runs several times slower for this copy, which dominates the decode step
    (docs/performance-history.md, 'Figures the code's comments quoted').
    """
    batch, num_blocks = tables.shape
    rows = cache.index_select(0, tables.flatten())
    return rows.view(batch, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _similar_length_groups(rows: list[int], lengths: list[int],
                           max_padding: float = 0.25) -> list[list[int]]:
    """Split rows, sorted by length, wherever padding to the group's longest would waste
    more than `max_padding` of the gathered K/V (the gather copy is the decode's cost)."""
    groups: list[list[int]] = []
    total = 0
    for row in sorted(rows, key=lambda r: lengths[r]):
        longest = lengths[row]
        if groups and longest * (len(groups[-1]) + 1) > (1 + max_padding) * (total + longest):
            groups.append([])
            total = 0
        if not groups:
            groups.append([])
        groups[-1].append(row)
        total += longest
    return groups


def _decode_batch(call: AttentionCall, starts: list[int], rows: list[int],
                  out: torch.Tensor) -> None:
    """The one-token queries of sequences `rows` at once, their K/V gathered into a padded
    batch."""
    query = call.query
    block_size = call.key_cache.shape[1]
    device = query.device
    row_index = torch.tensor(rows, device=device)
    token_index = torch.tensor([starts[i] for i in rows], device=device)
    lens = call.seq_lens[row_index].long()
    num_blocks = -(-int(lens.max()) // block_size)
    tables = call.block_tables[row_index, :num_blocks].long().clamp(min=0)  # RELEASED: masked
    # [batch, blocks, block_size, kv_heads, dim] -> [batch, kv_heads, padded_len, dim]
    keys = kv_quant.dequantize(_gather_blocks(call.key_cache, tables), query.dtype)
    values = kv_quant.dequantize(_gather_blocks(call.value_cache, tables), query.dtype)
    key_pos = torch.arange(keys.shape[2], device=device).unsqueeze(0)
    mask = key_pos < lens.unsqueeze(1)
    if call.sliding_window:
        mask &= key_pos >= lens.unsqueeze(1) - call.sliding_window
    q = query.index_select(0, token_index).unsqueeze(2)  # [batch, heads, 1, dim]
    result = _softmax_attention(q, keys, values, mask[:, None, None, :], call.scale,
                                call.soft_cap, call.sinks)
    out.index_copy_(0, token_index, result.squeeze(2).to(out.dtype))


def plain_to_blocked(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """blocked_to_plain's inverse: the weight [out, in] as blocks [out / tile, tile * in] of
    layout "AB16b<tile>a2b"."""
    out_features, in_features = weight.shape
    tiles = weight.reshape(out_features // tile, tile, in_features // 32, 16, 2)
    return tiles.permute(0, 2, 3, 1, 4).reshape(out_features // tile, tile * in_features).contiguous()


def blocked_to_plain(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """A weight [out, in] from oneDNN's layout "AB16b<T>a2b" given as blocks [out / T, T * in]
    (kernels/csrc/dense_linear.cpp describes it): tiles of T outputs x 32 inputs in
    output-tile-major order, each tile 16 input pairs x T outputs x the pair."""
    tile = blocks.shape[1] // in_features
    tiles = blocks.reshape(out_features // tile, in_features // 32, 16, tile, 2)
    return tiles.permute(0, 3, 1, 2, 4).reshape(out_features, in_features)


def blocked_rows(blocks: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` of a weight kept only as blocks [out / T, T * in] (the layout above): a
    token embedding looked up in a table kept in tiles, [*ids.shape, in]. Row o is output
    o % T of tile column o // T, whose inputs run tile by tile, pair by pair."""
    tile = blocks.shape[1] // in_features
    tiles = blocks.view(blocks.shape[0], in_features // 32, 16, tile, 2)
    flat = ids.reshape(-1)
    return tiles[flat // tile, :, :, flat % tile, :].reshape(*ids.shape, in_features)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """bf16 x @ weight.T + bias computed in fp32 and rounded to bf16 once, widened to
    out_dtype after (kernels/csrc/widened_gemm.cpp's contract)."""
    product = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return product.to(x.dtype).to(out_dtype or x.dtype)


def moe_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                gate_up: ExpertWeights, down: ExpertWeights, activation: str = "silu",
                kernel_max_rows: int = 0, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k experts (expert_ids [tokens, k]) run on its row and summed with its
    weights (expert_weights fp32 [tokens, k]): expert by expert, in ascending order, over
    the tokens that chose it, as transformers' experts modules run them. Dense
    ExpertWeights only (a packed module hands its de-quantized weights); the sums are fp32,
    rounded once to hidden's dtype. kernel_max_rows is the C++ op's and unused here; counts
    (int64 [experts]) gets each expert's number of tokens."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; supported: {list(EXPERT_ACTIVATIONS)}")
    if counts is not None:
        counts.copy_(torch.bincount(expert_ids.flatten(), minlength=gate_up.weight.shape[0]))
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in expert_ids.unique().tolist():
        token, slot = (expert_ids == expert).nonzero(as_tuple=True)
        gate_up_bias = None if gate_up.bias is None else gate_up.bias[expert]
        down_bias = None if down.bias is None else down.bias[expert]
        gate, up = F.linear(hidden[token], gate_up.weight[expert], gate_up_bias).chunk(2, dim=-1)
        rows = F.linear(expert_activation(gate, up, activation), down.weight[expert], down_bias)
        out.index_add_(0, token, rows.float() * expert_weights[token, slot, None])
    return out.to(hidden.dtype)


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """An expert's activation (kernel_ops.EXPERT_ACTIVATIONS) of its gate and up halves,
    computed in fp32 and rounded once."""
    if activation == "silu":
        return F.silu(gate) * up
    dtype = gate.dtype
    gate, up = gate.float().clamp(max=SWIGLU_LIMIT), up.float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)).to(dtype)


def read_words(words: torch.Tensor) -> int:
    """The sum of a contiguous int64 tensor's words, wrapping at 64 bits as torch's int64
    sum does: what the read-bandwidth probe computes (engine/worker/memory_bandwidth.py)."""
    return int(words.sum())
