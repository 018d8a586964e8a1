"""The Llama family (Llama 2/3/3.2, SmolLM2/3, Mistral, Qwen2/3, Phi-3/3.5/4-mini) and its
mixture-of-experts kin (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss: moe.py's layer as the
MLP) over paged attention: one layer code, whose per-layer differences (LayerKind) and
rotary table are read from the transformers config."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvscope.engine.worker.models.attention import (
    AttentionMetadata,
    PagedAttention,
    layer_windows,
)
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.decoder_stack import FusesDecoderStack
from kvscope.engine.worker.models.layers import Embedding, Linear, MergedLinear, RMSNorm, load_weights
from kvscope.engine.worker.models.moe import SparseMoeBlock, canonical_name, moe_config, sparse_layers
from kvscope.engine.worker.models.quantized import output_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Rotary types whose table depends only on the config (and, for longrope, on
# max_model_len); "dynamic" rescales per forward by the sequence's length, which a paged
# cache of keys rotated once cannot follow.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# RMSNorm of the queries and keys before the rotary: per head (Qwen3), or over the whole q
# and k projections (OLMoE)
HEAD_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
PROJECTION_QK_NORM_MODEL_TYPES = ("olmoe",)
SUPPORTED_ACTIVATIONS = ("silu",)  # the gate of the gated MLP (silu_and_mul)
SINK_MODEL_TYPES = ("gpt_oss",)  # attention sinks: a logit per query head in the softmax


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rotary parameters (transformers' standardized dict), refusing a rope type
    this table cannot compute."""
    parameters = dict(config.rope_parameters or {})
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model: rope_type {rope_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)}")
    return parameters


def inverse_frequencies(config: PretrainedConfig, max_model_len: int) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (of the rotated dims only: partial_rotary_factor
    rotates the first part of each head) and the attention factor scaling cos and sin,
    as transformers computes them.

    LongRoPE (Phi-3.5, Phi-4-mini) has short and long factors. transformers switches per
    forward by the sequence's length; a paged cache keeps keys rotated once, so, as vLLM
    does, the engine picks one for its life: the long factors when max_model_len exceeds
    original_max_position_embeddings, else the short ones.
    """
    parameters = rope_parameters(config)
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=max_model_len)
    dim = int(head_dim_of(config) * parameters.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (parameters["rope_theta"] ** exponents), 1.0


class RotaryTable(nn.Module):
    """cos/sin for every position (computed as transformers' rotary modules do, so every
    supported rope type matches them exactly), looked up by position instead of recomputed."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        inverse, attention_factor = inverse_frequencies(config, max_model_len)
        frequencies = torch.arange(max_positions).float()[:, None] * inverse.float()[None, :]
        angles = torch.cat((frequencies, frequencies), dim=-1)
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)

    def tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (cos, sin) table every layer reads, for the decoder stack."""
        return [(self.cos, self.sin)]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [tokens, rotary_dim], once per forward for every layer."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer does beyond a Llama layer, read from the model's config; the
    decoder stack takes the options that are no weight from `stack_options`."""

    qkv_bias: bool  # Qwen2; models with attention_bias
    # RMSNorm of queries and keys before the rotary: "head" per query and key head (Qwen3),
    # "projection" over the whole q and k projections (OLMoE); None: none
    qk_norm: str | None
    rotary: bool  # False on SmolLM3's NoPE layers (no_rope_layers marks them 0)
    sliding_window: int | None  # Mistral, Qwen2's windowed layers (layer_windows)
    sparse: bool = False  # the MLP is a mixture of experts (moe.sparse_layers)
    sinks: bool = False  # gpt-oss: a learned sink logit per query head in the softmax

    def stack_options(self) -> dict[str, int]:
        return {"rotary": int(self.rotary), "sliding_window": self.sliding_window or 0}


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    qkv_bias = (bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
                or bool(getattr(config, "qkv_bias", False)))  # Qwen2-MoE's name for it
    qk_norm = ("head" if config.model_type in HEAD_QK_NORM_MODEL_TYPES else
               "projection" if config.model_type in PROJECTION_QK_NORM_MODEL_TYPES else None)
    if qk_norm == "projection" and head_dim_of(config) * config.num_attention_heads != config.hidden_size:
        # transformers sizes OLMoE's norms by hidden_size // num_attention_heads per head
        raise ValueError(f"model: head_dim={head_dim_of(config)} must be hidden_size / "
                         f"num_attention_heads ({config.hidden_size // config.num_attention_heads}) "
                         f"for {config.model_type}'s q/k norms")
    uses_rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
    return [LayerKind(qkv_bias=qkv_bias, qk_norm=qk_norm, rotary=bool(uses_rope[index]),
                      sliding_window=window, sparse=sparse,
                      sinks=config.model_type in SINK_MODEL_TYPES)
            for index, (window, sparse) in enumerate(zip(layer_windows(config),
                                                         sparse_layers(config)))]


class LlamaAttention(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, kind: LayerKind) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.rotary = kind.rotary
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.num_heads * self.head_dim, kv_size, kv_size],
            bias=kind.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        if kind.qk_norm is not None:
            # over one head's dims, or over the whole projection's
            heads = (1, 1) if kind.qk_norm == "head" else (self.num_heads, self.num_kv_heads)
            self.q_norm = RMSNorm(heads[0] * self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(heads[1] * self.head_dim, config.rms_norm_eps)
        self.qk_norm = kind.qk_norm
        # fp32 whatever the model's dtype: the kernels read the sinks so
        self.sinks = (nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
                      if kind.sinks else None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, kind.sliding_window)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = self.qkv_proj.split(qkv)
        # The rotary turns the query and key heads in place: side by side in each qkv row,
        # or, after per-head norms (which write new rows), each on its own.
        rotated = [(qkv, self.num_heads + self.num_kv_heads)]
        if self.qk_norm == "head":
            tokens = qkv.shape[0]
            query = self.q_norm(query.view(tokens, self.num_heads, self.head_dim)).view(tokens, -1)
            key = self.k_norm(key.view(tokens, self.num_kv_heads, self.head_dim)).view(tokens, -1)
            rotated = [(query, self.num_heads), (key, self.num_kv_heads)]
        elif self.qk_norm == "projection":
            query, key = self.q_norm(query), self.k_norm(key)
            rotated = [(query, self.num_heads), (key, self.num_kv_heads)]
        if self.rotary:
            for rows, heads in rotated:
                self.ops.rotary_embedding(rows, cos, sin, heads, self.head_dim)
        return self.o_proj(self.attn(query, key, value, meta, self.sinks))


class LlamaMLP(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, size: int | None = None) -> None:
        """size: the intermediate width (a MoE model's shared expert has its own)."""
        super().__init__()
        activation = getattr(config, "hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"model: hidden_act {activation!r} is not supported; supported: "
                             f"{list(SUPPORTED_ACTIVATIONS)}")
        size = size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size],
                                         bias=getattr(config, "mlp_bias", False))
        self.down_proj = Linear(size, config.hidden_size,
                                   bias=getattr(config, "mlp_bias", False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


def sparse_mlp(config: PretrainedConfig) -> SparseMoeBlock:
    """A MoE layer's MLP, with its shared expert where the model has one (Qwen2-MoE)."""
    moe = moe_config(config)
    if not moe.shared_expert_size:
        return SparseMoeBlock(moe)
    return SparseMoeBlock(moe, LlamaMLP(config, moe.shared_expert_size),
                          Linear(config.hidden_size, 1, bias=False))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: LayerKind) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = LlamaAttention(config, kind)
        self.mlp = sparse_mlp(config) if kind.sparse else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, meta: AttentionMetadata):
        """hidden: the previous layer's output (or the embeddings, with residual None);
        returns this layer's output and the residual stream, which the next norm adds."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaBody(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, kind)
                                    for kind in layer_kinds(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTable(config, max_positions, max_model_len)


class LlamaForCausalLM(UsesKernelOps, FusesDecoderStack):
    """Parameter names follow transformers', so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        """max_positions: the rotary table's rows; max_model_len: the longest sequence the
        engine runs as it starts, which picks LongRoPE's factors."""
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, max_positions, max_model_len)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def stack_options(self) -> dict[str, float]:
        """The decoder stack's model options: a Llama-family model takes its defaults."""
        return {}

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if self.decoder_stack is not None:
            return self.decoder_stack(input_ids, positions, meta)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return self.model.norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.decoder_stack is not None:
            return self.decoder_stack.logits(hidden)
        projection = self.model.embed_tokens if self.tied else self.lm_head
        return output_logits(projection, hidden, self.ops.logits)

    def load_weights(self, weights) -> None:
        load_weights(self, ((canonical_name(name), tensor) for name, tensor in weights), PACKED,
                     skip={"lm_head.weight"} if self.tied else set())
