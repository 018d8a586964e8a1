"""What the block pool, the KV cache manager and the scheduler report as they change.

Typed, frozen records in the spirit of vLLM's KV events (BlockStored / BlockRemoved in
vllm/distributed/kv_events.py), emitted to an EventBus the core hands its parts. The core
does not know who listens: telemetry (kvscope.engine.telemetry.pool_recorder) turns the events
into per-step pool deltas, and any other reader can subscribe to the same bus.

Sequence events carry the Sequence itself (a listener reads its current block table and
tokens when it needs them); block events carry ids and hashes only.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.engine.core.request import BlockHash, Sequence


# ---- the block pool ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlocksAllocated:
    """Blocks taken from the free queue, one reference each (a cached-free one loses its
    content first: a BlockRemoved comes before)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksShared:
    """One more reference to each block (a prefix-cache hit or a fork)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksReleased:
    """One reference fewer to each block; one reaching zero is free again."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's content is cached: later prompts with this prefix can reuse it."""

    block_id: int
    block_hash: "BlockHash"
    group: int  # the KV cache group (engine.core.kv_groups) whose layers it holds


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block's content is forgotten (evicted for reuse, or the cache reset)."""

    block_id: int
    block_hash: "BlockHash"
    group: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block is gone at once: a reconfigure replaced the pool. Not emitted
    by the pool itself; AsyncEngine tells its KV-event subscribers (subscribe_kv_events)."""


# ---- the KV cache manager ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlockTableChanged:
    """seq.block_table[from_index:] is (or is about to be) new; earlier entries stay."""

    seq: "Sequence"
    from_index: int


# ---- the scheduler -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SequenceQueued:
    """A new sequence joined the waiting queue."""

    seq: "Sequence"


@dataclass(frozen=True, slots=True)
class SequenceResumed:
    """A detached sequence (a beam, a new fork) is back: running, or waiting to recompute."""

    seq: "Sequence"


class PreemptionReason(enum.StrEnum):
    """Why a sequence lost its device blocks; a str, for labels and logs."""

    KV_FULL = "kv_full"  # a running sequence's next tokens needed blocks the pool lacked
    PRIORITY = "priority"  # a waiting sequence ranked ahead needed the blocks to start
    MAX_NUM_SEQS = "max_num_seqs"  # a waiting sequence ranked ahead needed its seat


@dataclass(frozen=True, slots=True)
class SequencePreempted:
    """A sequence lost its device blocks (swapped out, or to recompute): why, who needed
    them (the taker; the victim itself when it gave way alone), how many blocks went back
    to the free queue and how many computed tokens it must compute again (0 when swapped)."""

    seq: "Sequence"
    reason: PreemptionReason
    taker: "Sequence"
    blocks_freed: int
    tokens_lost: int


class MissReason(enum.StrEnum):
    """Why a prompt's prefix-cache hit ended before tokens the cache had seen before."""

    EVICTED = "evicted"  # the next block was cached once, and evicted for another request
    PARTIAL_BLOCK = "partial_block"  # shared text ends mid-block: only full blocks cache
    SALT_MISMATCH = "salt_mismatch"  # the same tokens are cached under another cache_salt


@dataclass(frozen=True, slots=True)
class PrefixMiss:
    """A sequence's prefix lookup at admission missed `num_tokens` tokens the cache had seen
    (engine.core.prefix_misses): past its hit, the blocks `evicted_by` that request's
    allocation in step `evicted_step`, the leading tokens cached under another cache_salt,
    or the tokens a cached block shares with it before the two part mid-block (evicted_by
    and evicted_step None for the last two)."""

    seq: "Sequence"
    reason: MissReason
    num_tokens: int
    evicted_by: str | None = None
    evicted_step: int | None = None


@dataclass(frozen=True, slots=True)
class SequenceFinished:
    """A sequence left the queues for good (finished or aborted); its blocks are back."""

    seq: "Sequence"


# ---- a tier below the pool (engine.core.kv_offload) ------------------------------------------
@dataclass(frozen=True, slots=True)
class TierBlockStored:
    """A block's K/V is now held by a tier below the pool; `medium` names it as vLLM's KV
    events do ("DISK"). The pool itself did not change."""

    block_hash: "BlockHash"
    group: int
    medium: str


@dataclass(frozen=True, slots=True)
class TierBlockRemoved:
    """A tier below the pool dropped a block (its LRU eviction, a corrupt file)."""

    block_hash: "BlockHash"
    group: int
    medium: str


BlockEvent = (BlocksAllocated | BlocksShared | BlocksReleased | BlockStored | BlockRemoved
              | TierBlockStored | TierBlockRemoved)
SequenceEvent = (BlockTableChanged | SequenceQueued | SequenceResumed | SequencePreempted
                 | PrefixMiss | SequenceFinished)
KVEvent = BlockEvent | SequenceEvent
KVEventSink = Callable[[KVEvent], None]


class EventBus:
    """The sink the core hands its pool, cache manager and scheduler: `emit` calls every
    listener, in the emitting thread (the engine thread), so a listener must be cheap."""

    def __init__(self) -> None:
        self._listeners: tuple[KVEventSink, ...] = ()

    def subscribe(self, listener: KVEventSink) -> None:
        self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: KVEventSink) -> None:
        self._listeners = tuple(other for other in self._listeners if other is not listener)

    def emit(self, event: KVEvent) -> None:
        for listener in self._listeners:
            listener(event)


def discard(event: KVEvent) -> None:
    """The sink of a pool, cache manager or scheduler built on its own: nobody listens."""
