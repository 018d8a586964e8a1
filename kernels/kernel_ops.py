"""KernelOps: every kernel the engine calls, as one backend implements them.

The model runner picks one record at start-up (kvscope.kernels.select_ops) and hands it
down: to every module of the model (bound once, engine/worker/models/bound_ops.py), to the
decoder stack's construction and, through the runner, to the sampler. Nothing else chooses
or probes kernels. An op a backend lacks is either its plain-torch twin
(kernels/reference.py) or None, and the field's comment below says what a caller does then.

The small ops around a Llama-family layer's matmuls exist because eager PyTorch spends
more time dispatching a decode step's ~1,300 small ops than computing them; the C++
versions (kernels/csrc) do each group in one call, computing in fp32 and rounding where
eager does:

  rms_norm(hidden, weight, eps, residual=None) -> normed
      over the last dim of [tokens, hidden] or [tokens, heads, head_dim] rows (Qwen3's
      per-head q/k norms); with a residual: residual += hidden first (in place) and the
      sum is normalised
  rotary_embedding(qkv, cos, sin, heads, head_dim)
      neox rotary embedding in place on the first `heads` heads of each qkv row;
      cos / sin are fp32 [tokens, rotary_dim]: rotary_dim is head_dim, or less for
      partial rotary (Phi-4-mini), which rotates each head's first rotary_dim dims
  silu_and_mul(x) -> silu(x[:, :n]) * x[:, n:]
  linear(x, weight, bias) -> x @ weight.T + bias
      one row (a single stream's decode) streams the weights through a dot-product
      kernel: oneDNN's bf16 matmul reads them at well under the memory bandwidth there
      weight is a tensor or, where the backend prepacks (prepack_weight), a PrepackedWeight
  logits(hidden, weight) -> (hidden @ weight.T).float()
      the output projection in the model's dtype, handed over in fp32; the kernel writes
      one row's fp32 values itself (torch's conversion woke its OpenMP threads for it)

A mixture-of-experts layer's experts run as one op over a step's tokens:

  moe_experts(hidden, expert_ids, expert_weights, gate_up, down, activation,
              kernel_max_rows, counts=None) -> out
      hidden [tokens, in]; expert_ids int64 [tokens, k] (the router's choice) and
      expert_weights fp32 [tokens, k]; gate_up and down are ExpertWeights. Each token's
      out row is the sum over its k experts of weight * down(act(gate_up(row))), in fp32,
      rounded once to hidden's dtype (contract: reference.moe_experts). The tokens are
      grouped by expert, so each chosen expert's weights are read once per call;
      kernel_max_rows is where packed experts stop streaming and de-quantize for a GEMM
      (engine/worker/models/quantized.py's kernel_max_rows). counts (int64 [experts], or
      None) gets how many tokens each expert took: the model runner's expert_tokens.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionCall:
    """One paged-attention call: the arguments of every backend's paged_attention, written
    once (a new argument is a field here). The contract: reference.paged_attention."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    # [num_blocks, block_size, kv_heads, head_dim], or a quantized cache's rows of codes and
    # a scale (kernels/kv_quant.py)
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]: each sequence's KV length, its new tokens included
    query_start_loc: torch.Tensor  # [num_seqs + 1]: sequence i's tokens are query rows [s_i, s_i+1)
    scale: float
    out: torch.Tensor | None = None  # where the result goes; None: a new tensor
    _: KW_ONLY
    sliding_window: int | None = None  # W: the token at position p sees keys (p - W, p]
    soft_cap: float | None = None  # c: scores become c * tanh(scores / c)
    # fp32 [num_heads]: head h's learned logit joins its softmax's denominator as a key with no
    # value (gpt-oss's attention sinks): the weights of the real keys sum to less than 1
    sinks: torch.Tensor | None = None

    def check_block_tables(self) -> None:
        """A ValueError naming the sequence and the entry where a block-table entry that a
        sequence reads names no block of the cache: the entries from its first query token's
        window to its last key (those before the window may be -1, the KV manager's
        RELEASED, and are never read). An entry freed too early is refused here rather than
        read as an address. On a GPU this costs one host sync per call."""
        tables, (num_blocks, block_size) = self.block_tables, self.key_cache.shape[:2]
        lengths = self.seq_lens.long()
        query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        first_key = lengths - query_lens
        first_key = ((first_key - self.sliding_window + 1).clamp(min=0) if self.sliding_window
                     else torch.zeros_like(first_key))
        first, last = first_key // block_size, (lengths - 1) // block_size
        reads = query_lens > 0
        columns = torch.arange(tables.shape[1], device=tables.device)
        read = reads[:, None] & (columns >= first[:, None]) & (columns <= last[:, None])
        bad = read & ((tables < 0) | (tables >= num_blocks))
        short = reads & (last >= tables.shape[1])
        if not bool(bad.any() | short.any()):
            return
        for seq in range(len(lengths)):
            keys = f"its queries see keys {int(first_key[seq])}..{int(lengths[seq]) - 1}"
            if short[seq]:
                raise ValueError(f"block_tables: sequence {seq} needs {int(last[seq]) + 1} "
                                 f"entries ({keys}), but its row has {tables.shape[1]}")
            if bad[seq].any():
                entry = int(bad[seq].nonzero()[0])
                raise ValueError(
                    f"block_tables[{seq}][{entry}] = {int(tables[seq, entry])}, outside the "
                    f"cache's blocks [0, {num_blocks}), but sequence {seq} reads it ({keys})")


# paged_attention's signature, for help() and editors: AttentionCall's, returning the output.
_PAGED_ATTENTION_SIGNATURE = inspect.signature(AttentionCall).replace(
    return_annotation=torch.Tensor)


def paged_attention_op(attend: Callable[[AttentionCall], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A backend's `attend(call)` as its paged_attention, whose arguments are AttentionCall's
    fields (in order; sliding_window, soft_cap and sinks by keyword)."""

    @functools.wraps(attend)
    def paged_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        return attend(AttentionCall(*args, **kwargs))

    paged_attention.__signature__ = _PAGED_ATTENTION_SIGNATURE
    return paged_attention


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One projection of every expert of a mixture-of-experts layer, stacked along a first
    dimension of experts: dense [experts, out, in] in the model's dtype, or packed as
    engine/worker/models/quantized.py packs a linear: int4 (uint8 [experts, out, in / 2],
    float16 scales and offsets [experts, out, in / group_size]) or int8 (int8
    [experts, out, in], fp32 scales [experts, out]); or MXFP4 as gpt-oss ships it
    (kernels/mxfp4.py: uint8 blocks [experts, out, in / 32, 16], uint8 scales
    [experts, out, in / 32]). bias: [experts, out] or None. GGUF (the C++ kernels only):
    one GgufLinear over every expert's rows, `gguf` its runs of rows and `weight` their
    parts, int64 [runs, 3] (type code, first row, end row), `experts` of them sharing the
    rows equally."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    group_size: int = 0
    gguf: tuple[torch.Tensor, ...] = ()
    experts: int = 0

    @property
    def num_experts(self) -> int:
        return self.experts if self.gguf else self.weight.shape[0]


# The activations between an expert's gate/up and down projections, by name: the gate half
# of gate_up's outputs (the first half) through it, times the up half. "swigluoai" is
# gpt-oss's (vLLM's name): the gate clamped to at most SWIGLU_LIMIT and the up half to
# +-SWIGLU_LIMIT, then gate * sigmoid(SWIGLU_ALPHA * gate) * (up + 1).
EXPERT_ACTIVATIONS = ("silu", "swigluoai")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True, slots=True)
class PackedLinearKernels:
    """Matmuls over int4 / int8 packed weights (the layout of
    engine/worker/models/quantized.py), GGUF blocks and MXFP4, for the C++ CPU kernels
    only."""

    # x [rows, in] @ W.T + bias, streaming the packed weight once for a few rows
    int4_linear: Callable[..., torch.Tensor]
    int8_linear: Callable[..., torch.Tensor]
    # the dense [out, in] weight, for a GEMM over many rows
    int4_dequantize: Callable[..., torch.Tensor]
    int8_dequantize: Callable[..., torch.Tensor]
    # a GGUF tensor's blocks as the file stores them (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K; ggml's
    # type id) or repacked (GgufLinear.repack): gguf_linear(x, weight, type, bias, out)
    # writes x @ W.T + bias into out, gguf_dequantize(weight, type, in_features, dtype)
    # gives the dense weight
    gguf_linear: Callable[..., torch.Tensor]
    gguf_dequantize: Callable[..., torch.Tensor]
    # MXFP4 weights as shipped (kernels/mxfp4.py: blocks uint8 [out, in / 32, 16], scales
    # uint8 [out, in / 32]): mxfp4_linear(x, blocks, scales, bias, out_dtype=None) streams
    # them exactly (fp32 products of the exact weights), mxfp4_dequantize(blocks, scales,
    # dtype) gives the dense weight
    mxfp4_linear: Callable[..., torch.Tensor]
    mxfp4_dequantize: Callable[..., torch.Tensor]
    # whether int4_linear / int8_linear round bf16 activations to int8, one scale per 32
    # values (llama.cpp's Q8_0), for VNNI dot products; otherwise they compute exactly
    rounds_activations_to_int8: bool
    # whether gguf_linear rounds bf16 activations to int8 for integer dots, one scale per
    # 256 values for the k-quants (llama.cpp's q8_K), per 32 for the rest (on AVX512-VNNI
    # and on AVX2); otherwise it computes exactly
    gguf_rounds_activations_to_int8: bool
    # gguf_repacked_type(type, dtype): the type code that gguf_linear streams a GGUF type's
    # rows faster as, for activations in dtype, once repacked at load (quantized.py's
    # GgufLinear.repack), or -1: keep the file's blocks
    gguf_repacked_type: Callable[[int, torch.dtype], int]
    # whether this CPU's bf16 GEMMs run widened to fp32 (it lacks bf16 dot products): the
    # kernels that round activations to int8 then match or beat de-quantize + GEMM at any
    # row count
    widens_bf16_gemms: bool


@dataclass(frozen=True, slots=True)
class RecurrentKernels:
    """The ops of the recurrent layers (Qwen3.5's Gated DeltaNet, LFM2's short convolutions),
    whose per-sequence state lives in a pool row, its slot, read and updated in place
    (contracts: the same names in kernels/reference.py). S is the pool's number of slots.

      causal_conv1d_prefill(x [T, C], conv_state [S, C, W-1], slot: int, weight [C, W],
                            bias [C] | None, activation: None | "silu") -> y [T, C]
          one sequence's depthwise causal conv; conv_state[slot] (the W-1 inputs before x,
          zeros for a fresh sequence: the caller's job) is the left context and gets x's
          last W-1 inputs
      causal_conv1d_decode(x [B, C], conv_state, slots int64 [B], weight, bias, activation)
          -> y [B, C]: one input per sequence
      gated_delta_rule_prefill(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv],
                               beta [T, Hv], state fp32 [S, Hv, Dk, Dv], slot: int,
                               use_qk_l2norm: bool) -> o [T, Hv, Dv]
          one sequence's tokens; g is the log decay; value head h reads q/k head
          h // (Hv / Hk); per token: S = S exp(g); S += k (x) beta (v - S^T k);
          o = S^T q / sqrt(Dk)
      gated_delta_rule_decode(q [B, Hk, Dk], k, v [B, Hv, Dv], g [B, Hv], beta [B, Hv],
                              state, slots int64 [B], use_qk_l2norm) -> o [B, Hv, Dv]

    Outputs come in x's (q's) dtype; the arithmetic is fp32."""

    causal_conv1d_prefill: Callable[..., torch.Tensor]
    causal_conv1d_decode: Callable[..., torch.Tensor]
    gated_delta_rule_prefill: Callable[..., torch.Tensor]
    gated_delta_rule_decode: Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class PrepackedWeight:
    """A bf16 weight [out_features, in_features] kept once, in tiles for bf16 dot products:
    `blocks` is a plain bf16 tensor [out / T, T * in] (tiles of T outputs), which the blocked
    kernel streams. Either oneDNN's AMX layout (T = 32), with `onednn` the opaque oneDNN tensor
    over the same memory that feeds its GEMM, or kvscope's own (T = 64, `onednn` None)."""

    onednn: torch.Tensor | None
    blocks: torch.Tensor
    out_features: int
    in_features: int


@dataclass(frozen=True, slots=True)
class KernelOps:
    backend: str  # "triton", "cpu" or "torch" (kvscope.kernels.BACKENDS)
    # paged attention and the KV store (contracts: reference.paged_attention, store_kv),
    # over caches in the model's dtype and the quantized caches of kernels/kv_quant.py;
    # paged_attention takes AttentionCall's fields (paged_attention_op)
    paged_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    # the small ops around a layer's matmuls (contracts: this module's docstring)
    rms_norm: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    # a dense weight [out, in] -> its PrepackedWeight, or None where it stays as it is (not
    # bf16, a shape or layout the kernels do not take); the field None: weights stay plain
    prepack_weight: Callable[[torch.Tensor], PrepackedWeight | None] | None
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # every row's argmax token and its log_softmax, for fp32 logits [rows, vocab]:
    # (token ids, logprobs) as lists (contract: reference.greedy_tokens)
    greedy_tokens: Callable[[torch.Tensor], tuple[list[int], list[float]]]
    # the wrapping int64 sum of a contiguous int64 tensor's words, read as fast as the backend
    # can: the read-bandwidth probe (engine/worker/memory_bandwidth.py; contract:
    # reference.read_words)
    read_words: Callable[[torch.Tensor], int]
    # None: quantized layers de-quantize their weights with their plain-torch twin on
    # every forward (correct, but slower than dense)
    packed: PackedLinearKernels | None
    # a mixture-of-experts layer's experts over a step's tokens (contract: this module's
    # docstring and reference.moe_experts)
    moe_experts: Callable[..., torch.Tensor]
    # the recurrent layers' conv and delta-rule ops over state slots (RecurrentKernels)
    recurrent: RecurrentKernels
    # the constructor of the one-call Llama decoder stack (kvscope::LlamaDecoderStack);
    # None: the model runs its layers one by one
    decoder_stack: Callable[..., Any] | None
    # whether EngineConfig.prepack_weights left unset means on: where prepacked weights are
    # measured faster for batches and about as fast for one stream
    prepacks_by_default: bool = False
