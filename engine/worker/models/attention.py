"""The attention layer every model uses: store new K/V in the paged cache, attend over it."""

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.recurrent import StateMetadata


@dataclass(slots=True)
class AttentionMetadata:
    """The flat description of one ragged batch, shared by every layer of a forward."""

    # One slot mapping and one set of block tables per KV cache group (engine.core.kv_groups):
    # each layer reads its group's (PagedAttention.kv_group).
    slot_mapping: torch.Tensor  # [groups, num_tokens] int64: block * block_size + offset, -1 = skip
    block_tables: torch.Tensor  # [groups, num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    # A model with recurrent layers: each sequence's state slot and chunk rows.
    state: StateMetadata | None = None
    # Each group's rows as views, made once per forward (indexing a tensor per layer costs a
    # dispatcher call, twice per layer: docs/performance-history.md, 'Figures the code's
    # comments quoted').
    group_slot_mappings: tuple[torch.Tensor, ...] = field(init=False)
    group_block_tables: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.group_slot_mappings = self.slot_mapping.unbind(0)
        self.group_block_tables = self.block_tables.unbind(0)


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), read as transformers
    reads it: `layer_types` where the config has them (Qwen2, Gemma), else one
    `sliding_window` for every layer (Mistral)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * config.num_hidden_layers


class PagedAttention(UsesKernelOps):
    """Holds one layer's K/V cache views; the model runner binds the kernels at start-up
    and the views (and the KV cache group whose block tables it reads) after sizing the
    pool. sliding_window: the layer sees the last W positions only; soft_cap: its scores
    are soft-capped (kernels/reference.py)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.kv_group = 0

    def forward(
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
        meta: AttentionMetadata, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [tokens, heads * dim], key/value [tokens, kv_heads * dim] -> [tokens, heads * dim].
        key and value None: the caller shares this layer's K/V, which an earlier layer of the
        forward wrote (Gemma 4's KV-shared layers), and attends over them without writing.
        sinks: fp32 [heads], each head's sink logit (gpt-oss's attention sinks)."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        group = self.kv_group
        if key is not None:
            key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
            value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
            self.ops.store_kv(key, value, self.key_cache, self.value_cache,
                              meta.group_slot_mappings[group])
        out = self.ops.paged_attention(
            query, self.key_cache, self.value_cache, meta.group_block_tables[group], meta.seq_lens,
            meta.query_start_loc, self.scale, sliding_window=self.sliding_window,
            soft_cap=self.soft_cap, sinks=sinks,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
