"""Immutable records of what the engine did, for readers that must not touch its state."""

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens [start, end) of one sequence computed in a step; kind is prefill or decode."""

    request_id: str
    seq_id: str
    kind: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One EngineCore.step(): what ran, what was preempted, and the pool afterwards."""

    step: int
    start_time: float
    end_time: float
    chunks: tuple[ScheduledChunk, ...]
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
        tokens = block_hash.token_ids if block_hash else contents.get(block.block_id, ())
        blocks.append(BlockInfo(
            block.block_id, block.ref_count, state,
            block_hash.value.hex() if block_hash else None,
            block_hash.parent.hex() if block_hash and block_hash.parent else None,
            tokens, tuple(owners.get(block.block_id, ()))))
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
