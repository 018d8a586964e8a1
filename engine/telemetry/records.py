"""Immutable records of what the engine did, for readers that must not touch its state."""

from dataclasses import dataclass
from typing import NamedTuple

from kvscope.engine.core.request import BlockHash
from kvscope.engine.spec_decode.metrics import SpecDraft

# One chunk a step computed: (request_id, seq_id, kind, start, end), i.e. tokens
# [start, end) of one sequence, kind "prefill" or "decode". A plain tuple of str and int,
# not a record class: Python's cyclic garbage collector untracks such a tuple (and a tuple
# of them) within the first collections it survives, while an instance of any class, even a
# NamedTuple, stays tracked. A dashboard keeps 3,000 steps of 16 chunks here (hundreds at
# GPU batch sizes), and as dataclasses every full collection walked each of them, on
# whichever thread triggered it, the engine's included (bench/gc_pause.py;
# docs/performance-history.md, 'Figures the code's comments quoted').
ScheduledChunk = tuple[str, str, str, int, int]
CHUNK_FIELDS = ("request_id", "seq_id", "kind", "start", "end")
# One preemption: (victim seq_id, reason, taker seq_id, blocks freed, computed tokens lost),
# the reason a core.kv_events.PreemptionReason value, the taker the sequence whose
# admission or growth needed the blocks (the victim itself when it gave way alone). A plain
# tuple for the reason ScheduledChunk is one.
PreemptionCause = tuple[str, str, str, int, int]
PREEMPTION_FIELDS = ("victim", "reason", "taker", "blocks_freed", "tokens_lost")
# One admission's prefix miss on tokens the cache had seen: (seq_id, reason, tokens missed,
# the request whose allocation evicted them, the step it did so in), the reason a
# core.kv_events.MissReason value; the last two None for a partial block or another salt. A plain tuple for
# the reason ScheduledChunk is one.
PrefixMissCause = tuple[str, str, int, str | None, int | None]
PREFIX_MISS_FIELDS = ("seq_id", "reason", "num_tokens", "evicted_by", "evicted_step")
# The disk tier at one step (engine.core.kv_offload.tier.KVTier.step_counts): what it held
# after the step, then what it did since the previous step's record: blocks written and
# removed, loaded blocks and their bytes, prefix loads, and prompt tokens asked of it and
# found there (vLLM's external prefix cache counts). Empty without a tier. A plain tuple
# for the reason ScheduledChunk is one.
TierStep = tuple[int, int, int, int, int, int, int, int, int]
TIER_STEP_FIELDS = ("blocks_held", "bytes_held", "blocks_stored", "blocks_removed",
                    "blocks_loaded", "bytes_loaded", "loads", "query_tokens", "hit_tokens")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One EngineCore.step(): what ran, what was preempted, and the pool afterwards."""

    step: int
    start_time: float
    end_time: float
    chunks: tuple[ScheduledChunk, ...]  # plain tuples: see ScheduledChunk
    preempted: tuple[str, ...]
    swapped_out: tuple[str, ...]
    swapped_in: tuple[str, ...]
    finished: tuple[str, ...]
    num_scheduled_tokens: int
    token_budget: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_generated_tokens: int = 0
    # What this step added to the cache's statistics (readers sum them; none reaches into
    # the KV cache manager): prompt tokens looked up in the prefix cache and found there
    # (tokens, as vLLM counts), and blocks copied to and from the CPU swap pool.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    replica: int = 0  # which engine replica stepped (engine.replicas)
    # Speculative decoding: each proposal this step verified, (seq_id, tokens proposed,
    # tokens accepted); the rejected ones' slots were released (engine.spec_decode).
    spec_drafts: tuple[SpecDraft, ...] = ()
    # A mixture-of-experts model's routing (engine.telemetry.experts; empty for a dense
    # model): each MoE layer's decoder layer index, its tokens per expert (int32 counts as
    # one bytes object per layer: compact, and untracked by the collector like the chunks),
    # the bytes of weights the experts the step's tokens chose read (each once), and the
    # bytes all experts hold (what a dense model of the same size reads every step).
    expert_layers: tuple[int, ...] = ()
    expert_tokens: tuple[bytes, ...] = ()
    expert_bytes_read: int = 0
    expert_bytes_all: int = 0
    # Why each of `preempted` was, in the same order (see PreemptionCause).
    preemptions: tuple[PreemptionCause, ...] = ()
    # Why admissions this step missed tokens the prefix cache had seen (see PrefixMissCause).
    prefix_misses: tuple[PrefixMissCause, ...] = ()
    kv_tier: TierStep | tuple[()] = ()  # the disk tier's counts (see TierStep)

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One physical block as a reader sees it."""

    block_id: int
    ref_count: int
    state: str  # "free", "cached" (free but holds a hash), "used" (ref 1), "shared" (ref > 1)
    block_hash: str | None  # hex of the content hash, for cached/hashed blocks
    parent_hash: str | None
    token_ids: tuple[int, ...]  # what the block holds (empty for plain free blocks)
    owners: tuple[str, ...]  # sequence ids whose block tables point here


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    seq_id: str
    request_id: str
    status: str
    block_table: tuple[int, ...]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    arrival_time: float


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The whole cache and scheduler at one instant between steps: PoolMirror.snapshot()
    (kvscope.engine.telemetry.pool_mirror), the one route to it."""

    time: float
    step: int
    config: dict
    block_size: int
    num_blocks: int
    blocks: tuple[BlockInfo, ...]
    sequences: tuple[SequenceInfo, ...]
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int
    replica: int = 0  # which engine replica this is (engine.replicas)

    def count(self, state: str) -> int:
        return sum(1 for block in self.blocks if block.state == state)

    @property
    def num_used_tokens(self) -> int:
        """Tokens actually stored in blocks (shared blocks counted once)."""
        return sum(len(block.token_ids) for block in self.blocks
                   if block.state in ("used", "shared"))

    @property
    def blocks_saved_by_sharing(self) -> int:
        """Blocks the live sequences would hold without sharing, minus blocks in use."""
        # a sliding window's RELEASED entries (-1) hold no block
        held = sum(block_id >= 0 for seq in self.sequences for block_id in seq.block_table)
        in_use = sum(1 for block in self.blocks if block.ref_count > 0)
        return held - in_use


# ---- incremental telemetry: per-step pool deltas and a sliced full snapshot -------------
# A reader (ui.live, /ws/events) keeps a kvscope.engine.telemetry.pool_mirror.PoolMirror: one
# PoolBase and the PoolSlices that follow it when it starts (or falls behind), then one
# PoolDelta per step, all made by kvscope.engine.telemetry.pool_recorder.PoolRecorder. Every record
# holds references to the engine's immutable BlockHash objects, so the engine thread never
# formats anything.

BlockChange = tuple  # (block_id, ref_count, BlockHash | None): a touched block's new state


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """The scalars of the pool and scheduler after a step (cheap: copied every delta)."""

    step: int
    time: float
    num_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int
    config: dict  # the same dict object for the pool's whole life: not copied


class SequenceChange(NamedTuple):
    """A live sequence's new state. Idempotent: table[table_from:] = table_tail and
    token_ids[token_from:] = new_token_ids, so applying it twice changes nothing.

    Deltas carry these fields as a plain tuple (`SequenceChange._make(row)` names them):
    a reader's queue holds a second of deltas, ~16 changes a step, and like the step
    chunks (ScheduledChunk) plain tuples are untracked by the garbage collector."""

    seq_id: str
    request_id: str
    status: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    arrival_time: float
    table_from: int
    table_tail: tuple[int, ...]
    token_from: int
    new_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PoolDelta:
    """What one step (or a batch of aborts between steps) changed in the cache."""

    epoch: int  # the pool; a reconfigure starts a new epoch whose delta 0 starts empty
    index: int  # 0, 1, 2... per epoch: a gap means the reader missed one
    counters: PoolCounters
    blocks: tuple[BlockChange, ...]
    sequences: tuple[tuple, ...]  # SequenceChange fields, as plain tuples
    removed: tuple[str, ...]  # sequences that left the queues (finished or aborted)
    # Blocks that joined the back of the eviction order (freed with their content kept),
    # in the order they joined; and (block id, prefix-cache hits on its content) of the
    # touched blocks that have any, and of those evicted in the delta (0, unless hit since):
    # a block can be evicted and cached again with the same content in one step, and a
    # reader would then keep its old count.
    freed: tuple[int, ...] = ()
    hits: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PoolBase:
    """Start of a full snapshot for one reader: the state after delta `index - 1`, except
    the blocks, which come in PoolSlices interleaved with the deltas that follow."""

    epoch: int
    index: int
    counters: PoolCounters
    sequences: tuple[tuple, ...]  # SequenceChange fields, as plain tuples
    free_order: tuple[int, ...] = ()  # the cached-free blocks, next evicted first


@dataclass(frozen=True, slots=True)
class PoolSlice:
    """Blocks [start, start + len(ref_counts)) as they are when the slice is taken."""

    epoch: int
    start: int
    ref_counts: tuple[int, ...]
    hashes: tuple[tuple[int, BlockHash], ...]  # (block id, hash) of the hashed ones
    hits: tuple[tuple[int, int], ...] = ()  # (block id, prefix-cache hits) where any
