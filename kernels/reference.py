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


# The recurrent layers' ops (contracts: kernel_ops.RecurrentKernels). Each sequence's state
# lives in a pool row, its slot, which the ops read and update in place.

CONV_ACTIVATIONS = (None, "silu")
L2NORM_EPS = 1e-6  # transformers' (and the FLA library's) l2norm: x * rsqrt(sum(x^2) + eps)
DELTA_RULE_CHUNK = 64


def causal_conv1d_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: int,
                          weight: torch.Tensor, bias: torch.Tensor | None,
                          activation: str | None) -> torch.Tensor:
    """One sequence's depthwise causal convolution over its T new inputs x [T, C]: the slot's
    window conv_state[slot] [C, W-1] (the W-1 inputs before x) is the left context, and the
    last W-1 inputs are written back to it. Computed in fp32, rounded once to x's dtype."""
    check_conv_shapes(x, conv_state, weight, bias, activation)
    check_slot(slot, conv_state)
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    width = weight.shape[1]
    window = torch.cat((conv_state[slot].float(), x.float().T), dim=1)  # [C, W-1 + T]
    y = F.conv1d(window.unsqueeze(0), weight.float().unsqueeze(1),
                 None if bias is None else bias.float(), groups=weight.shape[0])[0]
    conv_state[slot] = window[:, window.shape[1] - (width - 1):]
    return _conv_activation(y.T, activation).to(x.dtype)


def causal_conv1d_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None) -> torch.Tensor:
    """One new input per sequence: x [B, C], sequence b's window in conv_state[slots[b]]."""
    check_conv_shapes(x, conv_state, weight, bias, activation)
    slots = slots.long()
    window = torch.cat((conv_state[slots].float(), x.float().unsqueeze(2)), dim=2)  # [B, C, W]
    y = (window * weight.float()).sum(dim=2)
    if bias is not None:
        y = y + bias.float()
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return _conv_activation(y, activation).to(x.dtype)


def _conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


def check_slot(slot: int, pool: torch.Tensor) -> None:
    """A ValueError for a prefill's slot outside the pool (a negative one would wrap around)."""
    if not 0 <= slot < pool.shape[0]:
        raise ValueError(f"slot {slot}: outside the pool's {pool.shape[0]} slots")


def check_conv_shapes(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, activation: str | None) -> None:
    """A ValueError naming the argument whose shape or value the causal conv cannot take."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: the causal conv supports {CONV_ACTIVATIONS}")
    if weight.dim() != 2 or weight.shape[1] < 2:
        raise ValueError(f"weight: needs shape [channels, width >= 2], got {list(weight.shape)}")
    channels, width = weight.shape
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"x: needs shape [rows, {channels}] (weight's channels), got {list(x.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (channels, width - 1):
        raise ValueError(f"conv_state: needs shape [slots, {channels}, {width - 1}] (weight's "
                         f"channels, width - 1), got {list(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias: needs shape [{channels}], got {list(bias.shape)}")


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                             slot: int, use_qk_l2norm: bool) -> torch.Tensor:
    """One sequence's gated delta rule over its T new tokens, in chunks of DELTA_RULE_CHUNK
    (the chunked form of transformers' torch_chunk_gated_delta_rule), from and back to the
    fp32 state[slot] [Hv, Dk, Dv]. Per token and value head, in fp32:
        S = S * exp(g);  S = S + k (x) (beta * (v - S^T k));  o = S^T (q / sqrt(Dk))
    q, k [T, Hk, Dk] (l2-normalised first if use_qk_l2norm); v [T, Hv, Dv]; g (the log
    decay), beta [T, Hv]; value head h reads q/k head h // (Hv / Hk). o [T, Hv, Dv] in q's
    dtype."""
    check_delta_rule_shapes(q, k, v, g, beta, state)
    check_slot(slot, state)
    length, chunk, out_dtype = q.shape[0], DELTA_RULE_CHUNK, q.dtype
    if length == 0:
        return v.new_empty(v.shape, dtype=out_dtype)
    q, k = _delta_rule_qk(q, k, v.shape[1], use_qk_l2norm)  # [Hv, T, Dk]
    v, g, beta = v.float().transpose(0, 1), g.float().T, beta.float().T
    pad = -length % chunk  # padded tokens have k = 0 and beta = 0: they change nothing
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    heads = v.shape[0]
    # [Hv, chunks, chunk, D] and [Hv, chunks, chunk]
    q, k, v = (t.reshape(heads, -1, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(heads, -1, chunk) for t in (g, beta))
    decay = g.cumsum(dim=2)  # log of the decay from the chunk's start through each token
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # pairwise[i, j]: the decay from token j to token i of a chunk, 0 where j > i
    pairwise = (decay.unsqueeze(3) - decay.unsqueeze(2)).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(3)
    # The corrections u_i = beta_i (v_i - (S before token i)^T k_i) of a chunk solve a unit
    # lower-triangular system whose strict lower part is the earlier corrections' share of
    # that read; solved once for the values and once for the chunk's initial state's share.
    system = k_beta @ k.transpose(2, 3) * pairwise
    new_values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(3), upper=False,
                                               unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(3),
                                               upper=False, unitriangular=True)
    within = q @ k.transpose(2, 3) * pairwise
    q_decayed = q * decay.exp().unsqueeze(3)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(3)
    chunk_decay = decay[..., -1].exp()
    s = state[slot].float()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        u = new_values[:, i] - state_keys[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + within[:, i] @ u
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(1, 2) @ u
    state[slot] = s
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1).to(out_dtype)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            slots: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """One new token per sequence, the recurrence of gated_delta_rule_prefill: q, k [B, Hk, Dk],
    v [B, Hv, Dv], g, beta [B, Hv]; sequence b's state is state[slots[b]]. o [B, Hv, Dv]."""
    check_delta_rule_shapes(q, k, v, g, beta, state)
    out_dtype, slots = q.dtype, slots.long()
    q, k = _delta_rule_qk(q, k, v.shape[1], use_qk_l2norm)  # [Hv, B, Dk]
    q, k = q.transpose(0, 1), k.transpose(0, 1)  # [B, Hv, Dk]
    s = state[slots].float() * g.float().exp()[..., None, None]  # [B, Hv, Dk, Dv]
    read = (s * k.unsqueeze(3)).sum(dim=2)
    s = s + k.unsqueeze(3) * ((v.float() - read) * beta.float().unsqueeze(2)).unsqueeze(2)
    state[slots] = s
    return (s * q.unsqueeze(3)).sum(dim=2).to(out_dtype)


def _delta_rule_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int,
                   use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in fp32 as [Hv, rows, Dk], one per value head, q scaled by 1/sqrt(Dk)."""
    group = value_heads // q.shape[1]
    q, k = (t.float().transpose(0, 1).repeat_interleave(group, dim=0) for t in (q, k))
    if use_qk_l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + L2NORM_EPS) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k


def check_delta_rule_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor) -> None:
    """A ValueError naming the argument whose shape or dtype the delta rule cannot take."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q, k: need one shape [rows, key_heads, key_dim], got "
                         f"{list(q.shape)} and {list(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise ValueError(f"v: needs shape [{q.shape[0]}, value_heads, value_dim] with value_heads "
                         f"a multiple of q's {q.shape[1]} key heads, got {list(v.shape)}")
    rows, heads = v.shape[:2]
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (rows, heads):
            raise ValueError(f"{name}: needs shape [{rows}, {heads}] (v's rows, value heads), "
                             f"got {list(t.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (heads, q.shape[2], v.shape[2]):
        raise ValueError(f"state: needs shape [slots, {heads}, {q.shape[2]}, {v.shape[2]}] "
                         f"(value heads, key_dim, value_dim), got {list(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"state: the delta rule keeps its state in torch.float32, got {state.dtype}")


def read_words(words: torch.Tensor) -> int:
    """The sum of a contiguous int64 tensor's words, wrapping at 64 bits as torch's int64
    sum does: what the read-bandwidth probe computes (engine/worker/memory_bandwidth.py)."""
    return int(words.sum())
