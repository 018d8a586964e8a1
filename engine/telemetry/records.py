"""Immutable records of what the engine did, for readers that must not touch its state."""

import time
from dataclasses import dataclass
from typing import NamedTuple

from kvscope.engine.core.block_pool import BlockHash

# One chunk a step computed: (request_id, seq_id, kind, start, end), i.e. tokens
# [start, end) of one sequence, kind "prefill" or "decode". A plain tuple of str and int,
# not a record class: Python's cyclic garbage collector untracks such a tuple (and a tuple
# of them) within the first collections it survives, while an instance of any class, even a
# NamedTuple, stays tracked. A dashboard keeps 3,000 steps of 16 chunks here (hundreds at
# GPU batch sizes), and as dataclasses every full collection walked each of them: 10-30 ms
# at a time, on whichever thread triggered it, the engine's included (bench/gc_pause.py).
ScheduledChunk = tuple[str, str, str, int, int]
CHUNK_FIELDS = ("request_id", "seq_id", "kind", "start", "end")


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
    """The whole cache and scheduler at one instant (taken between steps)."""

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
        held = sum(len(seq.block_table) for seq in self.sequences)
        in_use = sum(1 for block in self.blocks if block.ref_count > 0)
        return held - in_use


def take_snapshot(core) -> EngineSnapshot:
    """Copy what readers need out of an EngineCore; call it between steps (engine thread)."""
    manager = core.kv_cache
    pool = manager.pool
    block_size = manager.block_size
    live = core.live_sequences()
    holders = [seq for seq in live if seq.block_table]
    owners: dict[int, list[str]] = {}
    contents: dict[int, tuple[int, ...]] = {}
    for seq in holders:
        for index, block_id in enumerate(seq.block_table):
            owners.setdefault(block_id, []).append(seq.seq_id)
            stored = seq.token_ids[index * block_size:min((index + 1) * block_size,
                                                          seq.num_computed_tokens)]
            contents.setdefault(block_id, tuple(stored))
    blocks = []
    for block in pool.blocks:
        block_hash = block.block_hash
        if block.ref_count > 1:
            state = "shared"
        elif block.ref_count == 1:
            state = "used"
        else:
            state = "cached" if block_hash is not None else "free"
        value, parent, tokens = block_hash or (None, None, contents.get(block.block_id, ()))
        blocks.append(BlockInfo(
            block.block_id, block.ref_count, state, value.hex() if value else None,
            parent.hex() if parent else None, tokens, tuple(owners.get(block.block_id, ()))))
    sequences = tuple(
        SequenceInfo(seq.seq_id, seq.request.request_id, seq.status.value,
                     tuple(seq.block_table), seq.num_tokens, seq.num_prompt_tokens,
                     seq.num_computed_tokens, seq.request.arrival_time)
        for seq in live)
    stats = manager.prefix_stats
    return EngineSnapshot(
        time=time.time(), step=core.step_index, config=core.config.to_dict(),
        block_size=block_size, num_blocks=pool.num_blocks, blocks=tuple(blocks),
        sequences=sequences, num_running=core.num_running,
        num_waiting=len(core.scheduler.waiting), prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits, num_preemptions=core.scheduler.num_preemptions,
        num_evictions=pool.num_evictions)


# ---- incremental telemetry: per-step pool deltas and a sliced full snapshot -------------
# A reader (ui.live, /ws/events) keeps an engine.pool_mirror.PoolMirror: one PoolBase and
# the PoolSlices that follow it when it starts (or falls behind), then one PoolDelta per
# step. Every record holds references to the engine's immutable BlockHash objects, so the
# engine thread never formats anything.

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


@dataclass(frozen=True, slots=True)
class PoolBase:
    """Start of a full snapshot for one reader: the state after delta `index - 1`, except
    the blocks, which come in PoolSlices interleaved with the deltas that follow."""

    epoch: int
    index: int
    counters: PoolCounters
    sequences: tuple[tuple, ...]  # SequenceChange fields, as plain tuples


@dataclass(frozen=True, slots=True)
class PoolSlice:
    """Blocks [start, start + len(ref_counts)) as they are when the slice is taken."""

    epoch: int
    start: int
    ref_counts: tuple[int, ...]
    hashes: tuple[tuple[int, BlockHash], ...]  # (block id, hash) of the hashed ones


def _pool_counters(core) -> PoolCounters:
    manager, scheduler = core.kv_cache, core.scheduler
    log = manager.events
    if log.config is None:
        log.config = core.config.to_dict()
    return PoolCounters(
        core.step_index, time.time(), manager.pool.num_blocks, manager.block_size,
        core.num_running, len(scheduler.waiting), manager.prefix_stats.queries,
        manager.prefix_stats.hits, scheduler.num_preemptions, manager.pool.num_evictions,
        log.config)


def _sequence_change(seq, table_from: int, token_from: int) -> tuple:
    """A SequenceChange's fields, as a plain tuple."""
    return (
        seq.seq_id, seq.request.request_id, seq.status.value, seq.num_tokens,
        seq.num_prompt_tokens, seq.num_computed_tokens, seq.request.arrival_time,
        table_from, tuple(seq.block_table[table_from:]), token_from,
        tuple(seq.token_ids[token_from:]))


def take_pool_delta(core) -> PoolDelta:
    """Drain the pool's change log (engine thread). O(blocks and sequences touched, plus
    the sequences holding blocks, whose token counts move every step)."""
    log = core.kv_cache.events
    changed = log.sequences
    for seq in (*core.scheduler.running, *core.beams.parked):
        changed.setdefault(seq.seq_id, seq)
    sequences, removed = [], []
    for seq_id, seq in changed.items():
        last = log.sent.get(seq_id)
        if seq.status.value == "finished":
            if log.sent.pop(seq_id, None) is not None:
                removed.append(seq_id)
            continue
        state = (seq.status, seq.num_tokens, seq.num_computed_tokens)
        table_from = log.table_from.get(seq_id)
        if last is None:
            table_from, token_from = 0, 0
        elif table_from is None and last == state:
            continue
        else:
            token_from = last[1]
            if table_from is None:
                table_from = len(seq.block_table)
        sequences.append(_sequence_change(seq, table_from, token_from))
        log.sent[seq_id] = state
    delta = PoolDelta(
        log.epoch, log.num_deltas, _pool_counters(core),
        tuple((b.block_id, b.ref_count, b.block_hash) for b in log.blocks.values()),
        tuple(sequences), tuple(removed))
    log.blocks, log.sequences, log.table_from = {}, {}, {}
    log.num_deltas += 1
    return delta


def take_pool_base(core) -> PoolBase:
    """Every live sequence in full; take it right after take_pool_delta, so it is the
    state after that delta (engine thread; O(live sequences' tokens))."""
    log = core.kv_cache.events
    return PoolBase(log.epoch, log.num_deltas, _pool_counters(core), tuple(
        _sequence_change(seq, 0, 0) for seq in core.live_sequences()))


def take_pool_slice(core, start: int, size: int) -> PoolSlice:
    """Blocks [start, start + size): O(size) on the engine thread."""
    blocks = core.kv_cache.pool.blocks[start:start + size]
    return PoolSlice(core.kv_cache.events.epoch, start,
                     tuple(block.ref_count for block in blocks),
                     tuple((block.block_id, block.block_hash) for block in blocks
                           if block.block_hash is not None))
