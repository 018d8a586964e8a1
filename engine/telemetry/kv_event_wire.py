"""vLLM's KV events on the wire (vllm/distributed/kv_events.py, vLLM 0.32), and the core's
pool events made into them.

The batch is a msgspec array struct (ts, events, data_parallel_rank); each event is a
msgspec map struct tagged with its class name ({"type": "BlockStored", ...}), fields that
hold their default left out, as vLLM encodes them. A consumer of vLLM's events (llm-d's KV
cache manager, Dynamo's router) decodes kvscope's with vLLM's own classes or these:

    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)

tests/fixtures/kv_events_vllm-0.32.0.json holds bytes vLLM's classes made, which
tests/test_kv_event_wire.py holds these structs and `wire_events` to.

vLLM has no event for why blocks moved; kvscope's own (a preemption: why, for whom, what it
freed and lost; a prefix miss: why) ride in a fourth element of the batch array,
KVScopeEventBatch.kvscope_events, which vLLM's decoder skips: its batch is an array-like
struct, and msgspec ignores elements past an array-like struct's fields (not an unknown tag
in `events`, which it refuses). A batch with none of them is sent as a plain KVEventBatch,
byte for byte vLLM's:

    batch = msgspec.msgpack.decode(payload, type=KVScopeEventBatch)  # both kinds
"""

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from kvscope.engine.core import kv_events as core_events

# vLLM's ExternalBlockHash: kvscope's are the prefix cache's own 16-byte chained hashes.
ExternalBlockHash = bytes | int
MEDIUM_GPU = "GPU"  # vLLM's name for the device pool (kvscope: the model's device)
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"  # the disk tier below the pool (engine.core.kv_offload)
# vLLM's KVCacheSpecKind values for the two attention types kvscope's KV cache groups have
# (engine.core.kv_groups): vllm.v1.kv_cache_interface.get_kv_cache_spec_kind.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Every event of a batch: a map, tagged "type": its class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: `block_hashes` in prefix order, the first
    chained to `parent_block_hash` (None at the prompt's start), all of KV cache group
    `group_idx`, whose attention type the kv_cache_spec fields say."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM keeps it for old consumers; lora_name is the key now
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # multimodal, cache salt: none here
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # LOCAL or REMOTE to the publisher (offloading tiers)
    ownership: str | None = None  # an offloading tier's name
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVScopeEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """kvscope's own events: a map tagged "type", as vLLM's are; never in `events`."""


class SequencePreempted(KVScopeEvent):
    """A sequence lost its blocks: `reason` a core.kv_events.PreemptionReason value, `taker`
    the sequence that needed them (the victim itself when it gave way alone)."""

    request_id: str
    seq_id: str
    reason: str
    taker: str
    blocks_freed: int
    tokens_lost: int


class PrefixMiss(KVScopeEvent):
    """An admission's prefix hit ended before tokens the cache had seen: `reason` a
    core.kv_events.MissReason value; evicted_by and evicted_step for an eviction."""

    request_id: str
    seq_id: str
    reason: str
    num_tokens: int
    evicted_by: str | None = None
    evicted_step: int | None = None


class KVScopeEventBatch(KVEventBatch):
    """vLLM's batch and, past its three fields, kvscope's own events."""

    kvscope_events: list[SequencePreempted | PrefixMiss] = msgspec.field(default_factory=list)


def wire_reasons(events: Iterable[core_events.SequencePreempted | core_events.PrefixMiss],
                 ) -> list[KVScopeEvent]:
    """kvscope's events for the core's preemptions and prefix misses, in order."""
    out: list[KVScopeEvent] = []
    for event in events:
        seq = event.seq
        if isinstance(event, core_events.SequencePreempted):
            out.append(SequencePreempted(seq.request.request_id, seq.seq_id, event.reason.value,
                                         event.taker.seq_id, event.blocks_freed,
                                         event.tokens_lost))
        else:
            out.append(PrefixMiss(seq.request.request_id, seq.seq_id, event.reason.value,
                                  event.num_tokens, event.evicted_by, event.evicted_step))
    return out


def kv_cache_spec(window: int | None) -> tuple[str, int | None]:
    """A KV cache group's (kv_cache_spec_kind, kv_cache_spec_sliding_window) from its
    window (None: full attention), as vLLM reports its FullAttentionSpec and
    SlidingWindowSpec groups."""
    return (FULL_ATTENTION, None) if window is None else (SLIDING_WINDOW, window)


def wire_events(events: Iterable[core_events.BlockStored | core_events.BlockRemoved
                                 | core_events.TierBlockStored | core_events.TierBlockRemoved
                                 | core_events.AllBlocksCleared],
                medium: str, group_windows: Sequence[int | None]) -> list[KVCacheEvent]:
    """vLLM's events for the core's, in order; consecutive stores of one prefix (in one
    medium) become one BlockStored, as vLLM's cache_full_blocks sends them (each group's
    hashes chain to that group's own parents: block_pool.group_block_hash). `medium` is
    the pool's; a tier's events carry their own."""
    specs = [kv_cache_spec(window) for window in group_windows]
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, (core_events.BlockStored, core_events.TierBlockStored)):
            value, parent, token_ids = event.block_hash
            event_medium = (event.medium if isinstance(event, core_events.TierBlockStored)
                            else medium)
            last = out[-1] if out else None
            if (isinstance(last, BlockStored) and parent is not None
                    and last.medium == event_medium and last.block_hashes[-1] == parent):
                last.block_hashes.append(value)
                last.token_ids.extend(token_ids)
                continue
            kind, sliding_window = specs[event.group]
            out.append(BlockStored(
                block_hashes=[value], parent_block_hash=parent, token_ids=list(token_ids),
                block_size=len(token_ids), lora_id=None, medium=event_medium, lora_name=None,
                group_idx=event.group, kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=sliding_window))
        elif isinstance(event, (core_events.BlockRemoved, core_events.TierBlockRemoved)):
            out.append(BlockRemoved(block_hashes=[event.block_hash[0]],
                                    medium=(event.medium if isinstance(
                                        event, core_events.TierBlockRemoved) else medium),
                                    group_idx=event.group))
        else:
            out.append(AllBlocksCleared())
    return out
