"""The cpu backend: the C++ kernels (kernels/csrc) behind KernelOps' Python signatures.

The only module that reaches torch.ops.kvscope and torch.classes.kvscope: `kernel_ops()`
builds or loads the extension and hands out its record.
"""

import functools

import torch
import torch.nn.functional as F

from kvscope.kernels import cpu_extension, kv_quant, reference
from kvscope.kernels.kernel_ops import (
    AttentionCall,
    ExpertWeights,
    KernelOps,
    PackedLinearKernels,
    PrepackedWeight,
    RecurrentKernels,
    paged_attention_op,
)


@functools.cache
def kernel_ops() -> KernelOps:
    """The C++ versions of every op (builds or loads the extension; raises RuntimeError
    if it cannot)."""
    load()
    packed = PackedLinearKernels(
        int4_linear=int4_linear, int8_linear=int8_linear, int4_dequantize=int4_dequantize,
        int8_dequantize=int8_dequantize, gguf_linear=gguf_linear, gguf_dequantize=gguf_dequantize,
        rounds_activations_to_int8=torch.ops.kvscope.rounds_activations_to_int8(),
        gguf_rounds_activations_to_int8=torch.ops.kvscope.gguf_rounds_activations_to_int8(),
        gguf_repacked_type=gguf_repacked_type, mxfp4_linear=mxfp4_linear,
        mxfp4_dequantize=mxfp4_dequantize, widens_bf16_gemms=_widens_bf16_gemms)
    return KernelOps(
        backend="cpu", paged_attention=paged_attention, store_kv=store_kv,
        rms_norm=rms_norm,
        rotary_embedding=torch.ops.kvscope.rotary_embedding.default,
        silu_and_mul=silu_and_mul, linear=linear, logits=logits, greedy_tokens=greedy_tokens,
        read_words=torch.ops.kvscope.read_words.default,
        prepack_weight=prepack_weight if torch.ops.kvscope.has_blocked_linear() else None,
        packed=packed, moe_experts=moe_experts, recurrent=RECURRENT,
        decoder_stack=torch.classes.kvscope.LlamaDecoderStack,
        prepacks_by_default=prepacks_by_default())


def load() -> None:
    """Build or load the extension and give its ops the shape functions torch.compile needs."""
    global _widens_bf16_gemms
    cpu_extension.load()
    _register_fakes()
    _widens_bf16_gemms = torch.ops.kvscope.widens_bf16_gemms()


@paged_attention_op
def paged_attention(call: AttentionCall) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention; reads K/V in place."""
    query = call.query
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()  # the kernel takes rows of a fused projection as they are
    out = query.new_empty(query.shape) if call.out is None else call.out
    torch.ops.kvscope.paged_attention(
        query, call.key_cache, call.value_cache, call.block_tables.to(torch.int32),
        call.seq_lens.to(torch.int32), call.query_start_loc.to(torch.int32), call.scale, out,
        call.sliding_window or 0, call.soft_cap or 0.0, call.sinks)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.reference.store_kv; a quantized cache takes K/V as they
    are and quantizes them as it writes."""
    if not kv_quant.is_quantized(key_cache.dtype):
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    torch.ops.kvscope.store_kv(key, value, key_cache, value_cache, slot_mapping.to(torch.int64))


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(hidden)
    torch.ops.kvscope.rms_norm(hidden, weight, eps, out, residual)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.kvscope.silu_and_mul(x, out)
    return out


# Up to this many rows (a decode batch, or a speculative verification) read each weight once
# through the streaming kernel, which computes every row alike however many there are (each
# weight chunk meets a group of rows at a time). oneDNN's GEMM re-reads cold weights at a few
# dozen rows and rounds differently by batch shape: on a 2-core Zen 4 the default model's
# decode step at 9 to 32 rows took longer through it, about as long at 48 and less at 64
# (docs/performance-history.md, 'Dense linear of a few rows'). More rows are compute-bound:
# GEMM. Prepacked weights stream through the blocked kernel: over oneDNN's AMX tiles (32
# outputs) on AMX itself up to AMX_TILE_KERNEL_MAX_ROWS, past which oneDNN's AMX GEMM is
# faster; over kvscope's own 64-output tiles at every row count (its outputs need no
# horizontal sums, so it runs at the GEMM rate). kernels/csrc/llama_stack.cpp's
# kDenseKernelMaxRows and kAmxTileKernelMaxRows are the same.
DENSE_KERNEL_MAX_ROWS = 32
AMX_TILE_KERNEL_MAX_ROWS = 64
# Whether this CPU lacks bf16 dot products (AVX512-BF16, AMX), so that bf16 GEMMs of at least
# WIDENED_MIN_ROWS rows run as fp32 GEMMs over widened weight tiles
# (kernels/csrc/widened_gemm.cpp). Set by load(), from the build's own instruction set.
_widens_bf16_gemms = False
# Widening costs the same per call whatever the rows, so below this many rows oneDNN's bf16
# GEMM is as fast or faster (docs/performance-history.md, 'Batched bf16 GEMMs on a CPU
# without bf16 dot products', a 2-core Xeon: the two even at 32 rows, the widened one faster
# from 48 rows on). kernels/csrc/llama_stack.cpp's kWidenedMinRows is the same.
WIDENED_MIN_ROWS = 48


# The rows oneDNN is told to expect when it lays a weight out (its reorder's batch hint): a
# decode batch's size; the layout it picks is the same for prefill's thousands of rows.
PREPACK_ROWS_HINT = 64
# Tile widths (outputs): oneDNN's AMX layout, and kvscope's own for vdpbf16ps alone, whose
# 64 outputs are four vectors of sums (kernels/csrc/dense_linear.cpp; llama_stack.h's
# LinearWeights::kAmxTileOutputs and kOwnTileOutputs are the same).
AMX_TILE_OUTPUTS = 32
WIDE_TILE_OUTPUTS = 64


@functools.cache
def onednn_uses_amx() -> bool:
    """Whether oneDNN lays bf16 weights out in AMX tiles here (its GEMM then runs on AMX)."""
    probe = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return _onednn_amx_tiles(probe) is not None


def _onednn_amx_tiles(weight: torch.Tensor) -> PrepackedWeight | None:
    """The weight as oneDNN lays it out for its GEMM, if that is its AMX tiles: checked value
    for value, as oneDNN picks another layout on CPUs without AMX and may for some shapes."""
    out_features, in_features = weight.shape
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_ROWS_HINT)
    blocks = torch.ops.kvscope.onednn_weight_blocks(onednn)
    if blocks.numel() != weight.numel():
        return None
    blocks = blocks.view(out_features // AMX_TILE_OUTPUTS, AMX_TILE_OUTPUTS * in_features)
    if not torch.equal(reference.blocked_to_plain(blocks, out_features, in_features), weight):
        return None
    return PrepackedWeight(onednn=onednn, blocks=blocks, out_features=out_features,
                           in_features=in_features)


def prepacks_by_default() -> bool:
    """Whether `prepack_weights` is on unless set: wherever the blocked kernel streams the
    tiles (kvscope's own 64-output tiles on AVX512-BF16, oneDNN's AMX tiles on AMX itself):
    faster than the plain weight for batches, and as fast or faster for one row
    (docs/performance-history.md, "kvscope's own 64-output tiles" and 'Decode batches
    through AMX itself')."""
    if not torch.ops.kvscope.has_blocked_linear():
        return False
    return torch.ops.kvscope.has_amx_linear() or not onednn_uses_amx()


def prepack_weight(weight: torch.Tensor) -> PrepackedWeight | None:
    """The weight kept once in a tiled layout the blocked kernel streams: oneDNN's AMX tiles
    where the CPU has AMX (its GEMM reads them for more rows without reordering the weight
    per call: faster at decode batches, docs/performance-history.md, 'Batched GEMMs on
    AMX'), else kvscope's own 64-output tiles (the blocked kernel serves every row count).
    None where the weight cannot be tiled: not bf16, or a dimension not a multiple of the
    tile (32 inputs; 32 or 64 outputs)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    out_features, in_features = weight.shape
    if not onednn_uses_amx():
        if out_features % WIDE_TILE_OUTPUTS:
            return None
        return PrepackedWeight(onednn=None, blocks=reference.plain_to_blocked(weight, WIDE_TILE_OUTPUTS),
                               out_features=out_features, in_features=in_features)
    if out_features % AMX_TILE_OUTPUTS:
        return None
    return _onednn_amx_tiles(weight)


def linear(x: torch.Tensor, weight: "torch.Tensor | PrepackedWeight", bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A few rows through the streaming kernel, more through oneDNN's GEMM (F.linear, or
    over oneDNN's prepacked weight); any number over kvscope's own tiles through the blocked
    kernel. out_dtype float32 widens the result (the kernels write it so themselves)."""
    if isinstance(weight, PrepackedWeight):
        return _prepacked_linear(x, weight, bias, out_dtype)
    if x.shape[0] > DENSE_KERNEL_MAX_ROWS or x.dim() != 2 or x.stride(-1) != 1:
        if _widened(x, weight, bias):
            out = x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)
            torch.ops.kvscope.linear_widened(x, weight, bias, out)
            return out
        return F.linear(x, weight, bias).to(out_dtype or x.dtype)
    if x.dtype != weight.dtype:
        return F.linear(x, weight, bias).to(out_dtype or x.dtype)
    out = x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)
    torch.ops.kvscope.linear_small_batch(x, weight, bias, out)
    return out


def _prepacked_linear(x: torch.Tensor, weight: PrepackedWeight, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None) -> torch.Tensor:
    if weight.onednn is not None and x.shape[0] > AMX_TILE_KERNEL_MAX_ROWS:
        out = torch.ops.mkldnn._linear_pointwise(x, weight.onednn, bias, "none", [], "")
        return out.to(out_dtype or x.dtype)
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty(rows.shape[0], weight.out_features, dtype=out_dtype or x.dtype)
    torch.ops.kvscope.linear_blocked(rows, weight.blocks, bias, out)
    return out.view(*x.shape[:-1], weight.out_features)


def widens_bf16_gemms() -> bool:
    """Whether this CPU runs bf16 GEMMs of WIDENED_MIN_ROWS rows or more widened to fp32
    (it lacks bf16 dot products); False until load()."""
    return _widens_bf16_gemms


def _widened(x: torch.Tensor, weight, bias: torch.Tensor | None) -> bool:
    return (_widens_bf16_gemms and x.shape[0] >= WIDENED_MIN_ROWS and isinstance(weight, torch.Tensor)
            and x.dtype == weight.dtype == torch.bfloat16
            and x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(hidden, weight, out_dtype=torch.float32)


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Same contract as kernels.torch_ops.greedy_tokens, in one pass over each row."""
    # The model's logits are contiguous fp32 already; converting costs an op call even then.
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    return torch.ops.kvscope.greedy_tokens(logits)


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W.T + bias for the int4 layout of engine/worker/models/quantized.Int4Linear,
    streaming the packed weight once for up to 8 rows at a time (decode batches)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    torch.ops.kvscope.int4_linear(x, weight, scales, offsets, group_size, bias, out)
    return out


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [rows, in] @ (weight * scales[:, None]).T + bias with int8 weight, fp32 scales;
    out_dtype float32 widens a bf16 result (the kernel writes it so itself: logits)."""
    out = x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)
    torch.ops.kvscope.int8_linear(x, weight, scales, bias, out)
    return out


def int4_dequantize(weight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight of Int4Linear's layout, for a GEMM over many rows."""
    out = torch.empty(weight.shape[0], weight.shape[1] * 2, dtype=dtype)
    torch.ops.kvscope.int4_dequantize(weight, scales, offsets, group_size, out)
    return out


def int8_dequantize(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight of Int8Linear's layout, for a GEMM over many rows."""
    out = torch.empty(weight.shape, dtype=dtype)
    torch.ops.kvscope.int8_dequantize(weight, scales, out)
    return out


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor:
    """out [rows, out_features] (x's dtype or float32; its rows may be a wider output's
    columns) = x @ W.T + bias, W a GGUF tensor's rows of blocks as the file stores them."""
    torch.ops.kvscope.gguf_linear(x, weight, ggml_type, bias, out)
    return out


def gguf_dequantize(weight: torch.Tensor, ggml_type: int, in_features: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight of a GGUF tensor's rows of blocks."""
    out = torch.empty(weight.shape[0], in_features, dtype=dtype)
    torch.ops.kvscope.gguf_dequantize(weight, ggml_type, out)
    return out


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [rows, in] @ W.T + bias, W in MXFP4 (kernels/mxfp4.py) streamed as shipped;
    out_dtype float32 widens a bf16 result (the kernel writes it so itself)."""
    out = x.new_empty(x.shape[0], blocks.shape[0], dtype=out_dtype or x.dtype)
    torch.ops.kvscope.mxfp4_linear(x, blocks, scales, bias, out)
    return out


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight of MXFP4 blocks and scales, for a GEMM over many rows."""
    out = torch.empty(blocks.shape[0], blocks.shape[1] * 32, dtype=dtype)
    torch.ops.kvscope.mxfp4_dequantize(blocks, scales, out)
    return out


def gguf_repacked_type(ggml_type: int, dtype: torch.dtype) -> int:
    """The type code gguf_linear streams `ggml_type`'s rows faster as for activations in
    `dtype` once repacked at load, or -1: keep the file's blocks. The repacked forms run
    the int8 dots of bf16 activations; fp32 ones take the exact path either way."""
    return torch.ops.kvscope.gguf_repacked_type(ggml_type) if dtype == torch.bfloat16 else -1


def moe_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                gate_up: ExpertWeights, down: ExpertWeights, activation: str = "silu",
                kernel_max_rows: int = 0, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.reference.moe_experts, over dense or packed experts: the
    tokens grouped by expert in C++, each chosen expert's weights read once."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    out = torch.empty_like(hidden)
    torch.ops.kvscope.moe_experts(
        hidden, expert_ids.contiguous(), expert_weights.float().contiguous(), gate_up.weight,
        gate_up.bias, gate_up.scales, gate_up.offsets, down.weight, down.bias, down.scales,
        down.offsets, max(gate_up.group_size, down.group_size), kernel_max_rows, activation, out,
        counts, gate_up.num_experts, list(gate_up.gguf), list(down.gguf))
    return out


_fakes_registered = False


def causal_conv1d_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: int,
                          weight: torch.Tensor, bias: torch.Tensor | None,
                          activation: str | None) -> torch.Tensor:
    """Same contract as kernels.reference.causal_conv1d_prefill."""
    reference.check_conv_shapes(x, conv_state, weight, bias, activation)
    reference.check_slot(slot, conv_state)
    x, weight, bias, out = _conv_operands(x, weight, bias)
    torch.ops.kvscope.causal_conv1d_prefill(x, conv_state, slot, weight, bias, activation or "",
                                            out)
    return out


def causal_conv1d_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None) -> torch.Tensor:
    """Same contract as kernels.reference.causal_conv1d_decode."""
    reference.check_conv_shapes(x, conv_state, weight, bias, activation)
    x, weight, bias, out = _conv_operands(x, weight, bias)
    torch.ops.kvscope.causal_conv1d_decode(x, conv_state, slots.to(torch.int64).contiguous(),
                                           weight, bias, activation or "", out)
    return out


def _conv_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x with contiguous channels, the weight and bias in its dtype, and an output."""
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.to(x.dtype).contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    return x, weight, bias, torch.empty(x.shape, dtype=x.dtype)


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, slot: int,
                             use_qk_l2norm: bool) -> torch.Tensor:
    """Same contract as kernels.reference.gated_delta_rule_prefill, token by token (the state
    of each head's 16 columns stays in L1 through a tile of tokens)."""
    reference.check_delta_rule_shapes(q, k, v, g, beta, state)
    reference.check_slot(slot, state)
    *qkv, g, beta, out = _delta_rule_operands(q, k, v, g, beta)
    torch.ops.kvscope.gated_delta_rule_prefill(*qkv, g, beta, state, slot, use_qk_l2norm, out)
    return out


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            use_qk_l2norm: bool) -> torch.Tensor:
    """Same contract as kernels.reference.gated_delta_rule_decode; one read and one write of
    each sequence's state."""
    reference.check_delta_rule_shapes(q, k, v, g, beta, state)
    *qkv, g, beta, out = _delta_rule_operands(q, k, v, g, beta)
    torch.ops.kvscope.gated_delta_rule_decode(*qkv, g, beta, state,
                                              slots.to(torch.int64).contiguous(), use_qk_l2norm,
                                              out)
    return out


def _delta_rule_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor):
    """q, k, v in q's dtype with contiguous last dims (row and head strides as they come: the
    splits of a fused projection), g and beta contiguous fp32, and an output."""
    q, k, v = (t.to(q.dtype) if t.stride(2) == 1 else t.to(q.dtype).contiguous()
               for t in (q, k, v))
    g, beta = (t.float().contiguous() for t in (g, beta))
    return q, k, v, g, beta, torch.empty(v.shape, dtype=q.dtype)


RECURRENT = RecurrentKernels(
    causal_conv1d_prefill=causal_conv1d_prefill, causal_conv1d_decode=causal_conv1d_decode,
    gated_delta_rule_prefill=gated_delta_rule_prefill,
    gated_delta_rule_decode=gated_delta_rule_decode)


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    # These ops only write into tensors they are given: nothing to allocate when tracing.
    for op in ("paged_attention", "store_kv", "linear_widened", "int4_linear", "int8_linear",
               "int4_dequantize", "int8_dequantize", "gguf_linear", "gguf_dequantize",
               "mxfp4_linear", "mxfp4_dequantize", "moe_experts", "causal_conv1d_prefill",
               "causal_conv1d_decode", "gated_delta_rule_prefill", "gated_delta_rule_decode"):
        torch.library.register_fake(f"kvscope::{op}")(lambda *args: None)
    _fakes_registered = True
