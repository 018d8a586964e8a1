"""LFM2 (Liquid AI): short-convolution layers beside a few GQA attention layers, as
transformers' modeling_lfm2 does them.

A conv layer projects its input to three parts B, C and x, runs the depthwise causal
convolution (width conv_L_cache, no activation) over B * x, gates the result by C and
projects it back. Its cache is the last conv_L_cache - 1 inputs of the convolution per
sequence: a state slot (models/recurrent.py), not paged blocks. An attention layer is a
Llama attention with per-head q/k norms (llama.py's, its weights renamed at load), and
every layer's MLP is Llama's gated MLP (w1, w3, w2 for gate, up, down).

It runs its eager layers: the C++ decoder stack has no convolution layer.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from kvscope.engine.worker.models.attention import AttentionMetadata, PagedAttention
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.layers import Embedding, Linear, RMSNorm, load_weights
from kvscope.engine.worker.models.llama import LayerKind, LlamaAttention, LlamaMLP, RotaryTables
from kvscope.engine.worker.models.quantized import output_logits
from kvscope.engine.worker.models.recurrent import RecurrentLayer, StateMetadata, by_sequence

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}
# LFM2's checkpoint names -> the names of llama.py's modules they load into.
RENAMED = {".self_attn.out_proj.": ".self_attn.o_proj.",
           ".self_attn.q_layernorm.": ".self_attn.q_norm.",
           ".self_attn.k_layernorm.": ".self_attn.k_norm.",
           ".feed_forward.w2.": ".feed_forward.down_proj."}
ATTENTION_KIND = LayerKind(qkv_bias=False, qk_norm="head", rotary=True, sliding_window=None)


def mlp_size(config: PretrainedConfig) -> int:
    """The MLP's intermediate width, adjusted as transformers' Lfm2MLP adjusts it."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2ShortConv(RecurrentLayer):
    """in_proj -> B, C, x; C * conv(B * x) over the conv state; out_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, width = config.hidden_size, config.conv_L_cache
        if width < 2:
            raise ValueError(f"model: conv_L_cache={width}; LFM2's short convolution needs a "
                             "width of at least 2")
        self.in_proj = Linear(hidden, 3 * hidden, bias=config.conv_bias)
        self.out_proj = Linear(hidden, hidden, bias=config.conv_bias)
        # Holds the checkpoint's depthwise weight [hidden, 1, width] (and bias); the kernels
        # read the weight as [hidden, width].
        self.conv = nn.Conv1d(hidden, hidden, width, groups=hidden, bias=config.conv_bias)
        self.state_dtype = torch.get_default_dtype()  # the model's: the runner builds under it

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv.in_channels, self.conv.kernel_size[0] - 1),
                         self.state_dtype)}

    def forward(self, hidden: torch.Tensor, state: StateMetadata) -> torch.Tensor:
        gate_b, gate_c, x = self.in_proj(hidden).chunk(3, dim=-1)
        inputs = gate_b * x
        weight, bias, conv_state = self.conv.weight.squeeze(1), self.conv.bias, self.states["conv"]
        convolved = by_sequence(
            state, torch.empty_like(inputs),
            prefill=lambda start, end, slot: self.ops.recurrent.causal_conv1d_prefill(
                inputs[start:end], conv_state, slot, weight, bias, None),
            decode=lambda rows, slots: self.ops.recurrent.causal_conv1d_decode(
                inputs[rows], conv_state, slots, weight, bias, None))
        return self.out_proj(gate_c * convolved)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attention: bool) -> None:
        super().__init__()
        self.is_attention = attention
        if attention:
            self.self_attn = LlamaAttention(config, ATTENTION_KIND, norm_eps=config.norm_eps)
        else:
            self.conv = Lfm2ShortConv(config)
        self.feed_forward = LlamaMLP(config, mlp_size(config))
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, hidden, residual, cos, sin, meta: AttentionMetadata):
        """As LlamaDecoderLayer: returns the output and the residual stream, which the
        next norm adds."""
        if residual is None:
            residual = hidden
            hidden = self.operator_norm(hidden)
        else:
            hidden = self.operator_norm(hidden, residual)
        hidden = (self.self_attn(hidden, cos, sin, None, meta) if self.is_attention
                  else self.conv(hidden, meta.state))
        return self.feed_forward(self.ffn_norm(hidden, residual)), residual


class Lfm2Body(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(config, kind == "full_attention")
                                    for kind in config.layer_types)
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)  # the final norm
        self.rotary = RotaryTables(config, max_positions, max_model_len)


class Lfm2ForCausalLM(UsesKernelOps):
    """Parameter names follow transformers' (llama.py's modules under LFM2's names)."""

    no_decoder_stack_reason = "the C++ decoder stack has no short-convolution layer"

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        super().__init__()
        unknown = sorted(set(config.layer_types) - {"conv", "full_attention"})
        if unknown:
            raise ValueError(f"model: layer_types {unknown} are not supported; supported: "
                             "['conv', 'full_attention']")
        self.config = config
        self.model = Lfm2Body(config, max_positions, max_model_len)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.is_attention]

    def state_layers(self) -> list[RecurrentLayer]:
        return [layer.conv for layer in self.model.layers if not layer.is_attention]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        (cos, sin), = self.model.rotary(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return self.model.embedding_norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        projection = self.model.embed_tokens if self.tied else self.lm_head
        return output_logits(projection, hidden, self.ops.logits)

    def load_weights(self, weights) -> None:
        load_weights(self, ((_renamed(name), tensor) for name, tensor in weights), PACKED,
                     skip={"lm_head.weight"} if self.tied else set())


def _renamed(name: str) -> str:
    for old, new in RENAMED.items():
        name = name.replace(old, new)
    return name
