"""Qwen3.5 (text): Gated DeltaNet layers beside gated full-attention layers, as
transformers' modeling_qwen3_5 does them.

A Gated DeltaNet layer ("linear_attention") projects its input to q, k, v (through a
depthwise causal conv with silu), an output gate z, and per value head a write strength b
and a decay a; the gated delta rule folds each token's k, v into a [key_dim, value_dim]
state per value head and reads it with q; the result is RMS-normalised per head and gated
by silu(z). Its cache is the conv window and the delta-rule state per sequence: a state
slot (models/recurrent.py). A full-attention layer projects a gate beside each query head,
normalises q and k per head (Gemma's 1 + weight norm), rotates the first
partial_rotary_factor of each head and gates its output by sigmoid(gate). Text positions
only: the multimodal rotary's three sections then all carry the token's position, which
makes it the plain rotary.

It runs its eager layers: the C++ decoder stack has no recurrent layer.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvscope.engine.worker.models.attention import AttentionMetadata, PagedAttention
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.gemma import GemmaRMSNorm
from kvscope.engine.worker.models.layers import Embedding, Linear, MergedLinear, load_weights
from kvscope.engine.worker.models.llama import LlamaMLP, RotaryTables, head_dim_of, sparse_mlp
from kvscope.engine.worker.models.moe import canonical_name
from kvscope.engine.worker.models.multimodal import language_model_weights
from kvscope.engine.worker.models.quantized import output_logits
from kvscope.engine.worker.models.recurrent import RecurrentLayer, StateMetadata, by_sequence

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1),
          "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
LAYER_TYPES = ("linear_attention", "full_attention")
# Checkpoint tensors transformers itself leaves out of the text model: the multi-token
# prediction head.
SKIPPED_PREFIXES = ("mtp.",)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate), as Qwen3_5RMSNormGated."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * wide.to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = (config.linear_num_key_heads,
                                              config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"model: linear_num_value_heads={self.num_v_heads} must be a "
                             f"multiple of linear_num_key_heads={self.num_k_heads}")
        width = config.linear_conv_kernel_dim
        if width < 2:
            raise ValueError(f"model: linear_conv_kernel_dim={width}; the causal conv needs a "
                             "width of at least 2")
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.split_sizes = [key_dim, key_dim, value_dim]
        conv_dim = 2 * key_dim + value_dim
        self.in_proj = MergedLinear(config.hidden_size,
                                    [conv_dim, value_dim, self.num_v_heads, self.num_v_heads],
                                    bias=False)
        # Holds the checkpoint's depthwise weight [conv_dim, 1, width]; the kernels read it
        # as [conv_dim, width].
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_dim, config.hidden_size, bias=False)
        self.conv_dtype = torch.get_default_dtype()  # the model's: the runner builds under it

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv1d.in_channels, self.conv1d.kernel_size[0] - 1),
                         self.conv_dtype),
                # fp32, as the kernels keep the delta rule's state
                "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim),
                              torch.float32)}

    def forward(self, hidden: torch.Tensor, state: StateMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj.split(self.in_proj(hidden))
        ops = self.ops.recurrent
        weight, conv_state = self.conv1d.weight.squeeze(1), self.states["conv"]
        mixed = by_sequence(
            state, torch.empty_like(mixed),
            prefill=lambda start, end, slot: ops.causal_conv1d_prefill(
                mixed[start:end], conv_state, slot, weight, None, "silu"),
            decode=lambda rows, slots: ops.causal_conv1d_decode(
                mixed[rows], conv_state, slots, weight, None, "silu"))
        query, key, value = mixed.split(self.split_sizes, dim=-1)
        query = query.reshape(tokens, self.num_k_heads, self.head_k_dim)
        key = key.reshape(tokens, self.num_k_heads, self.head_k_dim)
        value = value.reshape(tokens, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        recurrent = self.states["recurrent"]
        out = by_sequence(
            state, torch.empty_like(value),
            prefill=lambda start, end, slot: ops.gated_delta_rule_prefill(
                query[start:end], key[start:end], value[start:end], decay[start:end],
                beta[start:end], recurrent, slot, True),
            decode=lambda rows, slots: ops.gated_delta_rule_decode(
                query[rows], key[rows], value[rows], decay[rows], beta[rows], recurrent,
                slots, True))
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(tokens, -1))


class GatedAttention(UsesKernelOps):
    """Full attention with a sigmoid gate per query head (the query projection's second
    half of each head's rows), per-head q/k norms and partial rotary."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     [2 * self.num_heads * self.head_dim, kv_size, kv_size],
                                     bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                             bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        query, gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query).reshape(tokens, -1)
        key = self.k_norm(key.view(tokens, self.num_kv_heads, self.head_dim)).reshape(tokens, -1)
        self.ops.rotary_embedding(query, cos, sin, self.num_heads, self.head_dim)
        self.ops.rotary_embedding(key, cos, sin, self.num_kv_heads, self.head_dim)
        attended = self.attn(query, key, value, meta)
        return self.o_proj(attended * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        mixed = self.input_layernorm(hidden)
        mixed = (self.linear_attn(mixed, meta.state) if self.is_linear
                 else self.self_attn(mixed, cos, sin, meta))
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3_5Body(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int,
                 mlp) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, kind, mlp(config))
                                    for kind in config.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions, max_model_len)


class Qwen3_5ForCausalLM(UsesKernelOps):
    """Parameter names follow transformers'. mlp(config): each layer's MLP (a dense gated
    MLP here; the mixture-of-experts model passes its sparse block)."""

    no_decoder_stack_reason = "the C++ decoder stack has no Gated DeltaNet layer"

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int,
                 mlp=LlamaMLP) -> None:
        super().__init__()
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"model: layer_types {unknown} are not supported; supported: "
                             f"{list(LAYER_TYPES)}")
        self.config = config
        self.model = Qwen3_5Body(config, max_positions, max_model_len, mlp)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[RecurrentLayer]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        (cos, sin), = self.model.rotary(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        projection = self.model.embed_tokens if self.tied else self.lm_head
        return output_logits(projection, hidden, self.ops.logits)

    def load_weights(self, weights) -> None:
        load_weights(self, ((canonical_name(name), tensor)
                            for name, tensor in language_model_weights(weights)
                            if not name.startswith(SKIPPED_PREFIXES)),
                     PACKED, skip={"lm_head.weight"} if self.tied else set())


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text): every layer's MLP a mixture of experts with a gated shared
    expert (moe.py's, as Qwen2-MoE's)."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__(config, max_positions, max_model_len, mlp=sparse_mlp)
