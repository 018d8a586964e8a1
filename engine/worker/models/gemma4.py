"""Gemma 4 (text; and the language model of Gemma4ForConditionalGeneration) over paged
attention, on Gemma 3's parts (gemma.py) where they are the same.

What it does beyond Gemma 3, as transformers' modeling_gemma4 does it:
- sliding and full layers of different shapes: transformers' `per_layer_config` gives each
  layer its head_dim (the full ones' is `global_head_dim`) and KV head count; with
  `attention_k_eq_v` a full layer has no value projection, its values being the keys'
  projection;
- proportional rope on the full layers (part of each head rotated, the rest passed through
  unchanged), sliding layers' default rope, from transformers' own rotary module;
- norms that scale by their weight (Gemma 3's by 1 + weight); values normalised too, without
  a weight; attention unscaled (scale 1: the q/k norms set the scores' scale);
- per-layer inputs (`hidden_size_per_layer_input`): a second embedding of every token, one
  slice per layer, mixed with a projection of the token's embedding, which each layer gates
  into its output;
- each layer's output scaled by its `layer_scalar`;
- KV sharing: the last `num_kv_shared_layers` layers project no keys or values; each attends
  over the cache of the last earlier layer of its type (which alone is bound to a cache:
  `attention_layers`).

It runs its eager layers: the C++ decoder stack takes one head shape for every layer and has
no value norm, per-layer inputs, layer scalars or shared caches (ModelRunner logs this).
Refused at load, naming the field: `enable_moe_block` (a mixture of experts beside each MLP)
and `use_bidirectional_attention="all"` (no causal mask).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvscope.engine.worker.models.attention import (
    AttentionMetadata,
    PagedAttention,
    layer_windows,
)
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.gemma import GemmaMLP, RotaryTables, soft_capped_logits
from kvscope.engine.worker.models.layers import Embedding, Linear, load_weights
from kvscope.engine.worker.models.multimodal import language_model_weights

PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# What a KV-shared layer's checkpoint entries may still hold; transformers drops them too.
SHARED_LAYER_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


def refuse_unsupported(config: PretrainedConfig) -> None:
    """A ValueError naming the config field of a Gemma 4 part kvscope does not run."""
    if getattr(config, "enable_moe_block", False):
        raise ValueError("model: Gemma 4's enable_moe_block=True (a mixture of experts beside "
                         "each MLP) is not supported; dense Gemma 4 models only "
                         "(enable_moe_block=False)")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("model: use_bidirectional_attention='all' is not supported; causal "
                         "attention only (None or 'vision', which text never uses)")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"model: hidden_activation {config.hidden_activation!r} is not "
                         "supported; supported: ['gelu_pytorch_tanh']")


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5, times the weight where it has one, in fp32 and rounded
    once, in transformers' very expression."""

    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.pow(wide.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            wide = wide * self.weight.float()
        return wide.type_as(x)


@dataclass(frozen=True)
class Gemma4LayerKind:
    """One decoder layer's shape and sharing, from the config's per_layer_config."""

    layer_type: str  # "sliding_attention" or "full_attention"
    rotary_table: int  # its layer type's index in RotaryTables
    sliding_window: int | None
    head_dim: int
    num_kv_heads: int
    keys_as_values: bool  # attention_k_eq_v on a full layer: no value projection
    kv_source: int | None  # the earlier layer whose K/V it attends over; None: its own
    intermediate_size: int  # double on KV-shared layers with use_double_wide_mlp


def gemma4_layer_kinds(config: PretrainedConfig) -> list[Gemma4LayerKind]:
    tables = {layer_type: index for index, layer_type in enumerate(sorted(set(config.layer_types)))}
    modes = config.kv_sharing_modes
    kinds = []
    for index, (layer_type, window) in enumerate(zip(config.layer_types, layer_windows(config),
                                                     strict=True)):
        layer = config.per_layer_config[index]
        shared = modes[index] == "reuse"
        # The producer transformers stores for this layer type: the last unshared one.
        source = max(earlier for earlier in range(index) if modes[earlier] != "reuse"
                     and config.layer_types[earlier] == layer_type) if shared else None
        wide = 2 if config.use_double_wide_mlp and shared else 1
        kinds.append(Gemma4LayerKind(
            layer_type, tables[layer_type], window, layer.head_dim, layer.num_key_value_heads,
            keys_as_values=config.attention_k_eq_v and layer_type != "sliding_attention",
            kv_source=source, intermediate_size=config.intermediate_size * wide))
    return kinds


class Gemma4Attention(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, kind: Gemma4LayerKind,
                 shared: PagedAttention | None) -> None:
        """shared: the PagedAttention of kind.kv_source, for a KV-shared layer."""
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, kind.head_dim
        self.num_kv_heads = kind.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias, eps = config.attention_bias, config.rms_norm_eps
        self.q_proj = Linear(config.hidden_size, q_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.projects_kv = shared is None
        if self.projects_kv:
            self.k_proj = Linear(config.hidden_size, kv_size, bias=bias)
            if not kind.keys_as_values:
                self.v_proj = Linear(config.hidden_size, kv_size, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.keys_as_values = kind.keys_as_values
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        self.attn = shared or PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                             1.0, kind.sliding_window)

    def heads(self, rows: torch.Tensor, heads: int) -> torch.Tensor:
        return rows.view(rows.shape[0], heads, self.head_dim)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        query = self.q_norm(self.heads(self.q_proj(hidden), self.num_heads)).view(tokens, -1)
        self.ops.rotary_embedding(query, cos, sin, self.num_heads, self.head_dim)
        key = value = None
        if self.projects_kv:
            projected = self.k_proj(hidden)
            raw_values = projected if self.keys_as_values else self.v_proj(hidden)
            key = self.k_norm(self.heads(projected, self.num_kv_heads)).view(tokens, -1)
            self.ops.rotary_embedding(key, cos, sin, self.num_kv_heads, self.head_dim)
            value = self.v_norm(self.heads(raw_values, self.num_kv_heads)).view(tokens, -1)
        return self.o_proj(self.attn(query, key, value, meta))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: Gemma4LayerKind,
                 shared: PagedAttention | None) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = Gemma4Attention(config, kind, shared)
        self.mlp = GemmaMLP(config, kind.intermediate_size)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(size, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            self.per_layer_input_gate = Linear(size, self.per_layer_size, bias=False)
            self.per_layer_projection = Linear(self.per_layer_size, size, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)

    def forward(self, hidden, per_layer_input, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mixed)
        if self.per_layer_size:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh")
            added = self.per_layer_projection(gate * per_layer_input)
            hidden = hidden + self.post_per_layer_input_norm(added)
        return hidden * self.layer_scalar


class Gemma4Body(nn.Module):
    """Named as transformers' Gemma4TextModel, so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        layers: list[Gemma4DecoderLayer] = []
        for kind in gemma4_layer_kinds(config):
            shared = None if kind.kv_source is None else layers[kind.kv_source].self_attn.attn
            layers.append(Gemma4DecoderLayer(config, kind, shared))
        self.layers = nn.ModuleList(layers)
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions)
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            width = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = Embedding(config.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size,
                                                           config.rms_norm_eps)
            self.projection_scale = config.hidden_size ** -0.5

    def per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Each token's per-layer inputs [tokens, layers, size]: its row of the per-layer
        embedding (scaled by sqrt(size)) and the normalised projection of its embedding
        (scaled by hidden_size^-0.5), summed and scaled by 2^-0.5."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        rows = self.embed_tokens_per_layer(input_ids)
        # The scale rounded to the model's dtype first, as transformers' scaled embedding does.
        rows = rows * torch.tensor(self.per_layer_size ** 0.5, dtype=rows.dtype)
        projected = self.per_layer_model_projection(embeddings) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + rows.view(shape)) * 2.0 ** -0.5


class Gemma4ForCausalLM(UsesKernelOps):
    """Gemma4ForCausalLM and the language model of Gemma4ForConditionalGeneration (its vision
    and audio towers are not loaded: text in, text out)."""

    no_decoder_stack_reason = ("Gemma 4's layers differ in head shape and add value norms, "
                               "per-layer inputs, layer scalars and shared KV caches, which the "
                               "C++ decoder stack does not run")

    def __init__(self, config: PretrainedConfig, max_positions: int,
                 max_model_len: int) -> None:
        """max_positions: the rotary tables' rows (max_model_len picks nothing here)."""
        super().__init__()
        refuse_unsupported(config)
        self.config = config
        self.model = Gemma4Body(config, max_positions)
        self.embedding_scale = config.hidden_size ** 0.5
        self.final_soft_cap = config.final_logit_softcapping
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[PagedAttention]:
        """The layers that write a KV cache (a KV-shared layer reads its source's)."""
        return [layer.self_attn.attn for layer in self.model.layers
                if layer.kind.kv_source is None]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        body = self.model
        hidden = body.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        per_layer = body.per_layer_inputs(input_ids, hidden) if body.per_layer_size else None
        tables = body.rotary(positions)
        for index, layer in enumerate(body.layers):
            layer_input = None if per_layer is None else per_layer[:, index]
            hidden = layer(hidden, layer_input, *tables[layer.kind.layer_type], meta)
        return body.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_capped_logits(self, hidden)

    def load_weights(self, weights) -> None:
        shared = {f"model.layers.{index}.self_attn.{name}.weight"
                  for index, layer in enumerate(self.model.layers)
                  if layer.kind.kv_source is not None for name in SHARED_LAYER_WEIGHTS}
        weights = ((name, tensor) for name, tensor in language_model_weights(weights)
                   if name not in shared)
        load_weights(self, weights, PACKED, skip={"lm_head.weight"} if self.tied else set())
