"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over paged attention."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.models.attention import AttentionMetadata, PagedAttention
from engine.models.layers import MergedLinear, RMSNorm, load_weights
from engine.models.quantized import tied_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(nn.Module):
    """cos/sin for every position, from transformers' own rotary module (so every rope
    scaling type matches it exactly), looked up by position instead of recomputed."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(max_positions).unsqueeze(0)
        cos, sin = rotary(torch.empty(0, dtype=torch.float32), positions)
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        # [tokens, 1, head_dim]: broadcast over heads
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, self.sin.index_select(0, positions).to(dtype).unsqueeze(1)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.num_heads * self.head_dim, kv_size, kv_size], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        return self.o_proj(self.attn(query.flatten(1), key.flatten(1), value, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size],
                                         bias=getattr(config, "mlp_bias", False))
        self.down_proj = nn.Linear(size, config.hidden_size,
                                   bias=getattr(config, "mlp_bias", False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(hidden))
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaBody(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTable(config, max_positions)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow transformers', so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, max_positions)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tied:
            return tied_logits(self.model.embed_tokens, hidden).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights) -> None:
        load_weights(self, weights, PACKED, skip={"lm_head.weight"} if self.tied else set())
