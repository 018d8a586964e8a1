"""PoolRecorder: one engine core's pool events, turned into the records a PoolMirror reads.

The recorder listens to the core's typed events (engine.core.kv_events) and notes what
they touched (a dict insert each); once per step `take_delta` turns the notes into one
PoolDelta. The cost is O(blocks and sequences touched), never O(pool), so watching a
million-block pool costs the engine what watching a thousand-block one does. A reader
that starts (or falls behind) gets `take_base` and then `take_slice`s: a full snapshot a
slice at a time.

Everything telemetry remembers between steps lives here, not in the core: the pool's
epoch, the deltas taken so far, what readers were last sent about each sequence, and the
config it reports.
"""

import itertools
import time

from kvscope.engine.core.kv_events import (
    BlockRemoved,
    BlocksAllocated,
    BlocksReleased,
    BlocksShared,
    BlockStored,
    BlockTableChanged,
    KVEvent,
    TierBlockRemoved,
    TierBlockStored,
)
from kvscope.engine.core.request import Sequence, SequenceStatus
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolDelta, PoolSlice
from kvscope.engine.telemetry.step_records import RecordedEngine

_epochs = itertools.count()


class PoolRecorder:
    """Follows one EngineCore's pool (a reconfigure builds a new core, and a new recorder:
    readers start over at its epoch). Used on the engine thread only."""

    def __init__(self, core: RecordedEngine) -> None:
        self.core = core
        self.epoch = next(_epochs)
        self.num_deltas = 0  # deltas taken so far; readers spot a missed one by the gap
        # The same dict in every record: not copied. With the KV cache groups' windows
        # (engine.core.kv_groups), which say how the block tables interleave.
        self.config = {**core.config.to_dict(),
                       "kv_cache_group_windows": list(core.kv_cache.group_windows)}
        # Since the last delta: touched block ids, in order of first touch; sequences whose
        # queue or block table changed; the lowest block-table index changed per sequence.
        self._blocks: dict[int, None] = {}
        self._sequences: dict[str, Sequence] = {}
        self._table_from: dict[str, int] = {}
        self._released: dict[int, None] = {}  # released block ids, in order of release
        self._evicted: set[int] = set()  # blocks whose content (and its hits) was forgotten
        # What readers were last told about each live sequence:
        # (status, num_tokens, num_computed_tokens).
        self._sent: dict[str, tuple] = {}

    def listen(self) -> "PoolRecorder":
        """Follow the core's events from now on (before its first request)."""
        self.core.events.subscribe(self.record)
        return self

    def record(self, event: KVEvent) -> None:
        match event:
            case BlocksReleased(block_ids):
                self._blocks.update(dict.fromkeys(block_ids))
                for block_id in block_ids:  # a block released twice: its last place counts
                    self._released.pop(block_id, None)
                    self._released[block_id] = None
            case BlocksAllocated(block_ids) | BlocksShared(block_ids):
                self._blocks.update(dict.fromkeys(block_ids))
            case BlockStored(block_id):
                self._blocks[block_id] = None
            case BlockRemoved(block_id):
                self._blocks[block_id] = None
                self._evicted.add(block_id)
            case TierBlockStored() | TierBlockRemoved():
                pass  # a tier below the pool changed, the pool did not
            case BlockTableChanged(seq, from_index):
                seq_id = seq.seq_id
                self._sequences[seq_id] = seq
                previous = self._table_from.get(seq_id)
                if previous is None or from_index < previous:
                    self._table_from[seq_id] = from_index
            case _:  # a scheduler's queue change
                self._sequences[event.seq.seq_id] = event.seq

    @property
    def pending(self) -> bool:
        """Whether anything changed since the last delta."""
        return bool(self._blocks or self._sequences)

    # ---- records -------------------------------------------------------------------------
    def take_delta(self) -> PoolDelta:
        """What changed since the last delta. O(blocks and sequences touched, plus the
        sequences holding blocks, whose token counts move every step)."""
        changed, sent = self._sequences, self._sent
        for seq in self.core.holding_sequences():
            changed.setdefault(seq.seq_id, seq)
        sequences, removed = [], []
        for seq_id, seq in changed.items():
            if seq.status is SequenceStatus.FINISHED:
                if sent.pop(seq_id, None) is not None:
                    removed.append(seq_id)
                continue
            last = sent.get(seq_id)
            state = (seq.status, seq.num_tokens, seq.num_computed_tokens)
            table_from = self._table_from.get(seq_id)
            if last is None:
                table_from, token_from = 0, 0
            elif table_from is None and last == state:
                continue
            else:
                token_from = last[1]
                if table_from is None:
                    table_from = len(seq.block_table)
            sequences.append(_sequence_change(seq, table_from, token_from))
            sent[seq_id] = state
        blocks = self.core.kv_cache.pool.blocks
        delta = PoolDelta(
            self.epoch, self.num_deltas, self._counters(),
            tuple((block_id, blocks[block_id].ref_count, blocks[block_id].block_hash)
                  for block_id in self._blocks),
            tuple(sequences), tuple(removed),
            # Released to no reference with their content kept: the back of the free queue.
            tuple(block_id for block_id in self._released if not blocks[block_id].ref_count
                  and blocks[block_id].block_hash is not None),
            tuple((block_id, blocks[block_id].num_hits) for block_id in self._blocks
                  if blocks[block_id].num_hits or block_id in self._evicted))
        self._blocks, self._sequences, self._table_from = {}, {}, {}
        self._released, self._evicted = {}, set()
        self.num_deltas += 1
        return delta

    def take_base(self) -> PoolBase:
        """Every live sequence in full and the eviction order; take it right after
        take_delta, so it is the state after that delta (O(live sequences' tokens and
        cached-free blocks))."""
        return PoolBase(self.epoch, self.num_deltas, self._counters(), tuple(
            _sequence_change(seq, 0, 0) for seq in self.core.live_sequences()),
            tuple(self.core.kv_cache.pool.cached_free_order()))

    def take_slice(self, start: int, size: int) -> PoolSlice:
        """Blocks [start, start + size): O(size)."""
        blocks = self.core.kv_cache.pool.blocks[start:start + size]
        return PoolSlice(self.epoch, start, tuple(block.ref_count for block in blocks),
                         tuple((block.block_id, block.block_hash) for block in blocks
                               if block.block_hash is not None),
                         tuple((block.block_id, block.num_hits) for block in blocks
                               if block.num_hits))

    def take_full(self) -> tuple[PoolBase, PoolSlice]:
        """A base and one slice of the whole pool: a full snapshot at once (O(pool), for a
        reader that asks for one, not for one that follows every step)."""
        return self.take_base(), self.take_slice(0, self.core.kv_cache.pool.num_blocks)

    def _counters(self) -> PoolCounters:
        core = self.core
        manager = core.kv_cache
        return PoolCounters(
            core.step_index, time.time(), manager.pool.num_blocks, manager.block_size,
            core.num_running, core.num_waiting, manager.prefix_stats.queries,
            manager.prefix_stats.hits, core.scheduler.num_preemptions,
            manager.pool.num_evictions, self.config)


def _sequence_change(seq: Sequence, table_from: int, token_from: int) -> tuple:
    """A SequenceChange's fields, as a plain tuple."""
    return (
        seq.seq_id, seq.request.request_id, seq.status.value, seq.num_tokens,
        seq.num_prompt_tokens, seq.num_computed_tokens, seq.request.arrival_time,
        table_from, tuple(seq.block_table[table_from:]), token_from,
        tuple(seq.token_ids[token_from:]))


def mirror_of(core: RecordedEngine) -> PoolMirror:
    """The core's pool as a PoolMirror, now (the route to a full snapshot for a core
    without an AsyncEngine: tests, tools)."""
    return PoolMirror.of(PoolRecorder(core).take_full())
