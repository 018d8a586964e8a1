"""vLLM's KV events on the wire (vllm/distributed/kv_events.py): msgspec structs encoded
as msgpack arrays, each event tagged with its class name. A consumer of vLLM's events
(llm-d's KV cache manager, Dynamo's router) decodes kvscope's with these same shapes:

    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
"""

from typing import Any

import msgspec

# vLLM's ExternalBlockHash: kvscope's are the prefix cache's own 16-byte chained hashes.
ExternalBlockHash = bytes | int
MEDIUM_GPU = "GPU"  # vLLM's name for the device pool (kvscope: the model's device)
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Every event of a batch; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: `block_hashes` in prefix order, the first
    chained to `parent_block_hash` (None at the prompt's start)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
