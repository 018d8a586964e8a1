"""OPT (the seeds' facebook/opt-125m example architecture) over paged attention."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from kvscope.engine.worker.models.attention import AttentionMetadata, PagedAttention
from kvscope.engine.worker.models.layers import MergedLinear, load_weights
from kvscope.engine.worker.models.quantized import output_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
POSITION_OFFSET = 2  # OPT's learned positions start at index 2


class OPTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = MergedLinear(dim, [dim, dim, dim], bias=config.enable_bias)
        self.out_proj = nn.Linear(dim, dim, bias=config.enable_bias)
        # transformers scales the query after its projection and attends with scale 1.
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, 1.0)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(query * self.scaling, key, value, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        affine = config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.fc1 = nn.Linear(dim, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = nn.Linear(config.ffn_dim, dim, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.activation_fn = ACT2FN[config.activation_function]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self._residual(hidden, self.self_attn_layer_norm,
                                lambda h: self.self_attn(h, meta))
        return self._residual(hidden, self.final_layer_norm,
                              lambda h: self.fc2(self.activation_fn(self.fc1(h))))

    def _residual(self, hidden, norm, block) -> torch.Tensor:
        """Pre-norm or post-norm (OPT-350m), as the config says."""
        if self.do_layer_norm_before:
            return hidden + block(norm(hidden))
        return norm(hidden + block(hidden))


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        proj_dim, dim = config.word_embed_proj_dim, config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, dim)
        self.project_in = nn.Linear(proj_dim, dim, bias=False) if proj_dim != dim else None
        self.project_out = nn.Linear(dim, proj_dim, bias=False) if proj_dim != dim else None
        keep_final_norm = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(dim, elementwise_affine=config.layer_norm_elementwise_affine)
                                 if keep_final_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))


class OPTBody(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    """Parameter names follow transformers'; the output projection is tied to the embedding."""

    def __init__(self, config: PretrainedConfig, max_positions: int, max_model_len: int) -> None:
        """As every model is built (models/__init__.py); learned positions have no choice
        that depends on max_model_len."""
        super().__init__()
        self.config = config
        self.model = OPTBody(config)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions(positions + POSITION_OFFSET)
        for layer in decoder.layers:
            hidden = layer(hidden, meta)
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(self.model.decoder.embed_tokens, hidden)

    def load_weights(self, weights) -> None:
        # Some OPT checkpoints name tensors without the leading "model.".
        renamed = ((name if name.startswith(("model.", "lm_head")) else f"model.{name}", t)
                   for name, t in weights)
        load_weights(self, renamed, PACKED, skip={"lm_head.weight"})
