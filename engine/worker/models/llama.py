"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over paged attention."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvscope.engine.worker.models.attention import (
    AttentionMetadata,
    PagedAttention,
    layer_windows,
)
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.layers import Linear, MergedLinear, RMSNorm, load_weights
from kvscope.engine.worker.models.quantized import kernel_max_rows, output_logits

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [tokens, head_dim], once per forward for every layer."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


class LlamaAttention(UsesKernelOps):
    def __init__(self, config: PretrainedConfig, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.num_heads * self.head_dim, kv_size, kv_size], bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, sliding_window)

    def forward(self, hidden, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        # In place on the query and key heads, which sit side by side in each qkv row.
        self.ops.rotary_embedding(qkv, cos, sin, self.num_heads + self.num_kv_heads,
                                  self.head_dim)
        query, key, value = self.qkv_proj.split(qkv)
        return self.o_proj(self.attn(query, key, value, meta))


class LlamaMLP(UsesKernelOps):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size],
                                         bias=getattr(config, "mlp_bias", False))
        self.down_proj = Linear(size, config.hidden_size,
                                   bias=getattr(config, "mlp_bias", False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, sliding_window)
        self.mlp = LlamaMLP(config)
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
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, window)
                                    for window in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTable(config, max_positions)


class FusedDecoderStack:
    """The token embedding, every decoder layer and the final norm in one C++ call
    (kvscope.LlamaDecoderStack), and the output projection in another.

    It chains the same C++ ops the modules call, with the same weights (dense, or int4 /
    int8 packed), so the result is the modules' result; what it saves is the Python
    between ~300 module and op calls, which costs a batch-1 decode step milliseconds. The
    weights are handed over once, here; a step passes only its own inputs. The model
    runner fuses it where the bound kernels have one (KernelOps.decoder_stack) unless
    enforce_eager is set.
    """

    def __init__(self, model: "LlamaForCausalLM", dtype: torch.dtype) -> None:
        body = model.model
        self.attention = [layer.self_attn.attn for layer in body.layers]
        first = self.attention[0]
        # The token embedding and the rotary lookups run in the same call, the output
        # projection in a second: called from Python after a step has streamed the weights,
        # their small ops and the Python around them would run cold (docs/performance.md).
        head = body.embed_tokens if model.tied else model.lm_head
        self.layers = model.ops.decoder_stack(
            embedding=body.embed_tokens.weight,
            embedding_scales=getattr(body.embed_tokens, "scales", None),
            head=head.weight, head_scales=getattr(head, "scales", None),
            cos=body.rotary.cos, sin=body.rotary.sin, final_norm=body.norm.weight,
            # Each layer's tensors by their parameter names (packed int4 / int8 linears add
            # scales, and int4 offsets, to weight and bias); the C++ side reads them by name.
            layers=[dict(layer.named_parameters()) for layer in body.layers],
            num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            group_size=getattr(body.layers[0].mlp.down_proj, "group_size", 0),
            kernel_max_rows=kernel_max_rows(model.ops.packed, dtype), eps=body.norm.eps,
            attention_scale=first.scale,
            sliding_windows=[layer.sliding_window or 0 for layer in self.attention])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final norm's rows, as output_logits computes them."""
        return self.layers.logits(hidden)

    def __call__(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        # The cache views change when the pool is resized, so they are read per call.
        return self.layers.forward(
            input_ids, positions, [layer.key_cache for layer in self.attention],
            [layer.value_cache for layer in self.attention], meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc)


class LlamaForCausalLM(UsesKernelOps):
    """Parameter names follow transformers', so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, max_positions)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.decoder_stack: FusedDecoderStack | None = None

    def fuse_decoder_stack(self, dtype: torch.dtype) -> None:
        """Run the layers as one call from now on (needs bound kernels with a decoder stack)."""
        self.decoder_stack = FusedDecoderStack(self, dtype)

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
        load_weights(self, weights, PACKED, skip={"lm_head.weight"} if self.tied else set())
