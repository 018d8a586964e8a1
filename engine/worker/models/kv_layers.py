"""The layers that write a model's KV cache, read from its config alone: what the replay's
simulator (which loads no weights) groups and sizes as the model runner does from the
model's own attention_layers()."""

from dataclasses import dataclass

from transformers import PretrainedConfig

from kvscope.engine.worker.models.attention import layer_windows
from kvscope.engine.worker.models.gemma4 import gemma4_layer_kinds

# Layer types that keep a recurrent state in a slot, not K/V (LFM2's, Qwen3.5's).
RECURRENT_LAYER_TYPES = ("conv", "linear_attention")


@dataclass(frozen=True)
class CacheLayer:
    window: int | None  # None: full attention
    num_kv_heads: int
    head_dim: int


def cache_layers(config: PretrainedConfig) -> list[CacheLayer]:
    """Each KV-writing layer's window and K/V shape, in order. Gemma 4's layers differ in
    shape and its KV-shared layers write nothing (gemma4.py); recurrent layers (LFM2's
    convolutions, Qwen3.5's Gated DeltaNet) write none either; every other model's layers
    are alike, one per decoder layer."""
    if config.model_type == "gemma4_text":
        return [CacheLayer(kind.sliding_window, kind.num_kv_heads, kind.head_dim)
                for kind in gemma4_layer_kinds(config) if kind.kv_source is None]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kinds = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    return [CacheLayer(window, kv_heads, head_dim)
            for window, kind in zip(layer_windows(config), kinds)
            if kind not in RECURRENT_LAYER_TYPES]
