"""Gemma 2 and Gemma 3 (text) over paged attention.

Both alternate sliding-window and global attention layers (`layer_types`) and differ from
Llama in the ways this file spells out: the token embedding scaled by sqrt(hidden), RMS
norms that scale by (1 + weight) in fp32, a norm after attention and around the MLP as
well as before, a GeGLU MLP (tanh-approximated gelu), attention scaled by
query_pre_attn_scalar^-0.5 rather than head_dim^-0.5. Gemma 2 soft-caps the attention
scores and the final logits; Gemma 3 normalises each query and key head instead and
gives each layer type its own rope base.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from kvscope.engine.worker.models.attention import (
    AttentionMetadata,
    PagedAttention,
    layer_windows,
)
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.decoder_stack import FusesDecoderStack
from kvscope.engine.worker.models.layers import Embedding, Linear, MergedLinear, load_weights
from kvscope.engine.worker.models.multimodal import language_model_weights
from kvscope.engine.worker.models.quantized import output_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32 and rounded once at the end, as Gemma does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide * (1.0 + self.weight.float())).type_as(x)


class RotaryTables(nn.Module):
    """cos/sin for every position and layer type, from transformers' own rotary module
    (Gemma 3 gives sliding and global layers different bases), looked up by position."""

    query_scale = None  # Gemma scales no query by position (llama.RotaryTables does for some)

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions).unsqueeze(0)
        anchor = torch.empty(0, dtype=torch.float32)
        self.layer_types = sorted(set(config.layer_types))
        for layer_type in self.layer_types:
            if config.model_type == "gemma2":
                cos, sin = Gemma2RotaryEmbedding(config)(anchor, positions)
            elif config.model_type == "gemma4_text":  # per layer type: its own head_dim
                cos, sin = Gemma4TextRotaryEmbedding(config)(anchor, positions, layer_type)
            else:
                cos, sin = Gemma3RotaryEmbedding(config)(anchor, positions, layer_type)
            self.register_buffer(f"cos_{layer_type}", cos[0], persistent=False)
            self.register_buffer(f"sin_{layer_type}", sin[0], persistent=False)

    def tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (cos, sin) tables in layer_types' order, for the decoder stack."""
        return [(getattr(self, f"cos_{kind}"), getattr(self, f"sin_{kind}"))
                for kind in self.layer_types]

    def forward(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """fp32 (cos, sin) [tokens, head_dim] per layer type, once per forward."""
        return {kind: (getattr(self, f"cos_{kind}").index_select(0, positions),
                       getattr(self, f"sin_{kind}").index_select(0, positions))
                for kind in self.layer_types}


@dataclass(frozen=True)
class GemmaLayerKind:
    """What sets one decoder layer apart, from `layer_types`; the decoder stack takes it as
    its layer options (`stack_options`)."""

    layer_type: str  # "sliding_attention" or "full_attention"
    rotary_table: int  # the index of its layer type's rotary table (RotaryTables.tables)
    sliding_window: int | None

    def stack_options(self) -> dict[str, int]:
        return {"rotary_table": self.rotary_table, "sliding_window": self.sliding_window or 0}


def gemma_layer_kinds(config: PretrainedConfig) -> list[GemmaLayerKind]:
    table = {layer_type: index for index, layer_type in enumerate(sorted(set(config.layer_types)))}
    return [GemmaLayerKind(layer_type, table[layer_type], window)
            for layer_type, window in zip(config.layer_types, layer_windows(config), strict=True)]


class GemmaAttention(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                     bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.qk_norm = config.model_type != "gemma2"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim,
            config.query_pre_attn_scalar ** -0.5, sliding_window,
            getattr(config, "attn_logit_softcapping", None))

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.qk_norm:
            query = self.q_norm(query.reshape(tokens, self.num_heads, self.head_dim))
            key = self.k_norm(key.reshape(tokens, self.num_kv_heads, self.head_dim))
        # Query and key heads side by side, as the rotary kernel takes them, rotated in place.
        query_key = torch.cat((query.reshape(tokens, -1), key.reshape(tokens, -1)), dim=-1)
        self.ops.rotary_embedding(query_key, cos, sin, self.num_heads + self.num_kv_heads,
                                  self.head_dim)
        query, key = query_key.split([self.num_heads * self.head_dim,
                                      self.num_kv_heads * self.head_dim], dim=-1)
        return self.o_proj(self.attn(query, key, value, meta))


class GemmaMLP(UsesKernelOps):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)); size: its width, where a layer's differs
    from the config's intermediate_size (Gemma 4's double-wide MLPs)."""

    def __init__(self, config: PretrainedConfig, size: int | None = None) -> None:
        super().__init__()
        size = size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(hidden))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: GemmaLayerKind) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = GemmaAttention(config, kind.sliding_window)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class GemmaBody(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, kind)
                                    for kind in gemma_layer_kinds(config))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions)


class GemmaForCausalLM(UsesKernelOps, FusesDecoderStack):
    """Gemma2ForCausalLM, Gemma3ForCausalLM, and the language model of
    Gemma3ForConditionalGeneration (its vision tower is not loaded: text in, text out).
    Parameter names follow transformers', so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, max_positions: int,
                 max_model_len: int) -> None:
        """max_positions: the rotary tables' rows (max_model_len picks nothing here)."""
        super().__init__()
        self.config = config
        self.model = GemmaBody(config, max_positions)
        self.embedding_scale = config.hidden_size ** 0.5
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)
        self.attention_soft_cap = getattr(config, "attn_logit_softcapping", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def stack_options(self) -> dict[str, float]:
        """What the decoder stack does differently for Gemma (its C++ ModelOptions)."""
        return {"embedding_scale": self.embedding_scale, "norm_unit_offset": 1.0,
                "gelu_tanh": 1.0, "attention_soft_cap": self.attention_soft_cap or 0.0,
                "final_soft_cap": self.final_soft_cap or 0.0}

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if self.decoder_stack is not None:
            return self.decoder_stack(input_ids, positions, meta)
        hidden = self.model.embed_tokens(input_ids)
        # The scale rounded to the model's dtype first, as transformers does.
        hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        tables = self.model.rotary(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, *tables[layer.kind.layer_type], meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.decoder_stack is not None:
            return self.decoder_stack.logits(hidden)
        return soft_capped_logits(self, hidden)

    def load_weights(self, weights) -> None:
        load_weights(self, language_model_weights(weights), PACKED,
                     skip={"lm_head.weight"} if self.tied else set())


def soft_capped_logits(model: UsesKernelOps, hidden: torch.Tensor) -> torch.Tensor:
    """A Gemma model's logits from its output projection (its embedding where tied), soft-
    capped where its config caps them (final_soft_cap)."""
    projection = model.model.embed_tokens if model.tied else model.lm_head
    logits = output_logits(projection, hidden, model.ops.logits)
    if model.final_soft_cap:
        logits = torch.tanh(logits / model.final_soft_cap) * model.final_soft_cap
    return logits
