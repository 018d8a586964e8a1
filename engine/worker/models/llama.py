"""The Llama family (Llama 2/3/3.2, SmolLM2/3, Mistral, Ministral 3, Qwen2/3,
Phi-3/3.5/4-mini, Olmo 3) and its mixture-of-experts kin (Qwen3-MoE, Qwen2-MoE, OLMoE,
Mixtral, gpt-oss: moe.py's layer as the MLP) over paged attention: one layer code, whose
per-layer differences (LayerKind) and rotary tables are read from the transformers config."""

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
from kvscope.engine.worker.models.multimodal import language_model_weights
from kvscope.engine.worker.models.quantized import output_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Rotary types whose table depends only on the config (and, for longrope, on
# max_model_len); "dynamic" rescales per forward by the sequence's length, which a paged
# cache of keys rotated once cannot follow.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# RMSNorm of the queries and keys before the rotary: per head (Qwen3), or over the whole
# projection, every head at once (Olmo 3, OLMoE).
QK_NORM_MODEL_TYPES = {"qwen3": "head", "qwen3_moe": "head", "olmo3": "projection",
                       "olmoe": "projection"}
# Olmo 3's layer: no norm before attention or the MLP; each one's output is normalised
# before it joins the residual stream.
POST_NORM_MODEL_TYPES = ("olmo3",)
# Llama 4's attention temperature, which Ministral 3 applies: each query scaled by
# 1 + beta * log(1 + floor(position / original_max_position_embeddings)) after the rotary.
QUERY_SCALE_MODEL_TYPES = ("ministral3",)
SUPPORTED_ACTIVATIONS = ("silu",)  # the gate of the gated MLP (silu_and_mul)
SINK_MODEL_TYPES = ("gpt_oss",)  # attention sinks: a logit per query head in the softmax


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_layer_types(config: PretrainedConfig) -> list[str] | None:
    """The layer types whose rotary parameters the config keys apart (Olmo 3: sliding and
    full layers, each its own rope), sorted as transformers' rotary module sorts them; None
    where one set of parameters serves every layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) <= set(config.rope_parameters or {}):
        return sorted(set(layer_types))
    return None


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's rotary parameters (transformers' standardized dict; a layer type's own,
    where rope_layer_types keys them), refusing a rope type this table cannot compute."""
    parameters = dict(config.rope_parameters or {})
    if layer_type is not None:
        parameters = dict(parameters[layer_type])
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model: rope_type {rope_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_ROPE_TYPES)}")
    return parameters


def inverse_frequencies(config: PretrainedConfig, max_model_len: int,
                        layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (of the rotated dims only: partial_rotary_factor
    rotates the first part of each head) and the attention factor scaling cos and sin,
    as transformers computes them.

    LongRoPE (Phi-3.5, Phi-4-mini) has short and long factors. transformers switches per
    forward by the sequence's length; a paged cache keeps keys rotated once, so, as vLLM
    does, the engine picks one for its life: the long factors when max_model_len exceeds
    original_max_position_embeddings, else the short ones.
    """
    parameters = rope_parameters(config, layer_type)
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        by_type = {} if layer_type is None else {"layer_type": layer_type}
        return ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=max_model_len, **by_type)
    dim = int(head_dim_of(config) * parameters.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (parameters["rope_theta"] ** exponents), 1.0


class RotaryTable(nn.Module):
    """cos/sin for every position (computed as transformers' rotary modules do, so every
    supported rope type matches them exactly), looked up by position instead of recomputed;
    layer_type: the layers whose own rotary parameters it follows (rope_layer_types)."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        inverse, attention_factor = inverse_frequencies(config, max_model_len, layer_type)
        frequencies = torch.arange(max_positions).float()[:, None] * inverse.float()[None, :]
        angles = torch.cat((frequencies, frequencies), dim=-1)
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [tokens, rotary_dim]."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def query_scales(config: PretrainedConfig, max_positions: int) -> torch.Tensor | None:
    """Ministral 3's query scale per position, fp32 [max_positions, 1], computed by
    transformers' own expression over the same positions (so equal to it bit for bit); None
    for a model that scales no query."""
    if config.model_type not in QUERY_SCALE_MODEL_TYPES:
        return None
    parameters = rope_parameters(config)
    beta = parameters.get("llama_4_scaling_beta")
    original = parameters.get("original_max_position_embeddings")
    if beta is None or original is None:
        raise ValueError("model: rope_parameters.llama_4_scaling_beta and "
                         "rope_parameters.original_max_position_embeddings are required for "
                         f"{config.model_type} (its queries are scaled by position); got "
                         f"{beta!r} and {original!r}")
    # fp32 whatever the model's dtype: transformers divides the int64 positions in fp32.
    positions = torch.arange(max_positions, dtype=torch.float32)
    return (1 + beta * torch.log(1 + torch.floor(positions / original)))[:, None]


class RotaryTables(nn.Module):
    """What the layers read by position, once per forward: a RotaryTable per rope setting
    (one, or one per layer type where the config keys them: rope_layer_types; a layer reads
    LayerKind.rotary_table's), and the query scale of a model that has one (query_scales)."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        self.rotations = nn.ModuleList(
            RotaryTable(config, max_positions, max_model_len, layer_type)
            for layer_type in rope_layer_types(config) or [None])
        scales = query_scales(config, max_positions)
        self.register_buffer("query_scale", scales, persistent=False)

    def tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (cos, sin) tables in rotary_table order, for the decoder stack."""
        return [(table.cos, table.sin) for table in self.rotations]

    def forward(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """fp32 (cos, sin) [tokens, rotary_dim] per table."""
        return [table(positions) for table in self.rotations]

    def query_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """fp32 [tokens, 1]: each token's query scale; None where queries are not scaled."""
        return None if self.query_scale is None else self.query_scale.index_select(0, positions)


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer does beyond a Llama layer, read from the model's config; the
    decoder stack takes the options that are no weight from `stack_options`."""

    qkv_bias: bool  # Qwen2; models with attention_bias
    # RMSNorm of queries and keys before the rotary: "head" per head (Qwen3), "projection"
    # over all heads at once (Olmo 3, OLMoE); None: none
    qk_norm: str | None
    rotary: bool  # False on SmolLM3's NoPE layers (no_rope_layers marks them 0)
    sliding_window: int | None  # Mistral, Qwen2's and Olmo 3's windowed layers (layer_windows)
    post_norms: bool = False  # Olmo 3: attention and MLP outputs normalised, inputs not
    rotary_table: int = 0  # which of RotaryTables' tables it reads (Olmo 3: per layer type)
    sparse: bool = False  # the MLP is a mixture of experts (moe.sparse_layers)
    sinks: bool = False  # gpt-oss: a learned sink logit per query head in the softmax

    def stack_options(self) -> dict[str, int]:
        # The norms' placement and width the stack reads from the weights' names and sizes.
        return {"rotary": int(self.rotary), "sliding_window": self.sliding_window or 0,
                "rotary_table": self.rotary_table}


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    qkv_bias = (bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
                or bool(getattr(config, "qkv_bias", False)))  # Qwen2-MoE's name for it
    qk_norm = QK_NORM_MODEL_TYPES.get(config.model_type)
    # transformers sizes OLMoE's norms by hidden_size // num_attention_heads per head
    olmoe_width = config.hidden_size // config.num_attention_heads
    if config.model_type == "olmoe" and head_dim_of(config) != olmoe_width:
        raise ValueError(f"model: head_dim={head_dim_of(config)} must be hidden_size / "
                         f"num_attention_heads ({olmoe_width}) "
                         f"for {config.model_type}'s q/k norms")
    uses_rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
    rope_types = rope_layer_types(config)
    tables = [rope_types.index(kind) for kind in config.layer_types] if rope_types else None
    return [LayerKind(qkv_bias=qkv_bias, qk_norm=qk_norm, rotary=bool(uses_rope[index]),
                      sliding_window=window, post_norms=config.model_type in POST_NORM_MODEL_TYPES,
                      rotary_table=tables[index] if tables else 0, sparse=sparse,
                      sinks=config.model_type in SINK_MODEL_TYPES)
            for index, (window, sparse) in enumerate(zip(layer_windows(config),
                                                         sparse_layers(config)))]


class LlamaAttention(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, kind: LayerKind,
                 norm_eps: float | None = None) -> None:
        """norm_eps: the q/k norms' epsilon where the config names it otherwise than
        rms_norm_eps (LFM2's norm_eps)."""
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
            eps = config.rms_norm_eps if norm_eps is None else norm_eps
            self.q_norm = RMSNorm(heads[0] * self.head_dim, eps)
            self.k_norm = RMSNorm(heads[1] * self.head_dim, eps)
        self.qk_norm = kind.qk_norm
        # fp32 whatever the model's dtype: the kernels read the sinks so
        self.sinks = (nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
                      if kind.sinks else None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, kind.sliding_window)

    def forward(self, hidden, cos, sin, query_scale, meta: AttentionMetadata) -> torch.Tensor:
        """query_scale: [tokens, 1] each query's scale after the rotary, or None."""
        qkv = self.qkv_proj(hidden)
        query, key, value = self.qkv_proj.split(qkv)
        # The rotary turns the query and key heads in place: side by side in each qkv row,
        # or, after q/k norms (which write new rows), each on its own.
        rotated = [(qkv, self.num_heads + self.num_kv_heads)]
        if self.qk_norm == "head":
            tokens = qkv.shape[0]
            query = self.q_norm(query.view(tokens, self.num_heads, self.head_dim)).view(tokens, -1)
            key = self.k_norm(key.view(tokens, self.num_kv_heads, self.head_dim)).view(tokens, -1)
        elif self.qk_norm == "projection":
            query, key = self.q_norm(query), self.k_norm(key)
        if self.qk_norm:
            rotated = [(query, self.num_heads), (key, self.num_kv_heads)]
        if self.rotary:
            for rows, heads in rotated:
                self.ops.rotary_embedding(rows, cos, sin, heads, self.head_dim)
        if query_scale is not None:
            query.mul_(query_scale.to(query.dtype))  # as transformers: in the query's dtype
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
        if kind.post_norms:
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, query_scale, meta: AttentionMetadata):
        """hidden: the previous layer's output (or the embeddings, with residual None);
        returns this layer's output and the residual stream, which the next norm adds."""
        if self.kind.post_norms:
            return self.post_norm_forward(hidden, residual, cos, sin, query_scale, meta)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, query_scale, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def post_norm_forward(self, hidden, residual, cos, sin, query_scale, meta):
        """Olmo 3: attention and MLP read the residual stream itself; their outputs are
        normalised (post_attention_layernorm, post_feedforward_layernorm) as they join it."""
        residual = hidden if residual is None else residual.add_(hidden)
        attended = self.self_attn(residual, cos, sin, query_scale, meta)
        residual.add_(self.post_attention_layernorm(attended))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class LlamaBody(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, kind)
                                    for kind in layer_kinds(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions, max_model_len)


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
        tables = self.model.rotary(positions)
        query_scale = self.model.rotary.query_scales(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, *tables[layer.kind.rotary_table],
                                     query_scale, meta)
        return self.model.norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.decoder_stack is not None:
            return self.decoder_stack.logits(hidden)
        projection = self.model.embed_tokens if self.tied else self.lm_head
        return output_logits(projection, hidden, self.ops.logits)

    def load_weights(self, weights) -> None:
        load_weights(self, ((canonical_name(name), tensor)
                            for name, tensor in language_model_weights(weights)), PACKED,
                     skip={"lm_head.weight"} if self.tied else set())
