"""A reader's own copy of the KV pool, kept current from the engine's per-step deltas.

The engine sends one PoolBase and its PoolSlices when a reader starts (or falls behind),
then one PoolDelta per step (kvscope.engine.telemetry.pool_recorder). Applying a delta costs the reader
O(blocks and sequences it touches); whole-pool questions (state counts, a heatmap row)
are numpy over the mirror's arrays, never Python loops over a million block objects.
"""

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvscope.engine.core.request import BlockHash
from kvscope.engine.telemetry.records import (
    BlockInfo,
    EngineSnapshot,
    PoolBase,
    PoolCounters,
    PoolDelta,
    PoolSlice,
    SequenceChange,
    SequenceInfo,
)

if TYPE_CHECKING:  # pool_history builds on this module
    from kvscope.engine.telemetry.pool_history import PoolHistory

STATES = ("free", "cached", "used", "shared")  # index = the state's code


def hash_key(value: bytes) -> int:
    """A block hash's first 8 bytes as an integer: numpy can sort and match a million of
    them at once (hash values are unique among cached blocks; sha256 prefixes of 64 bits
    collide with odds of ~1e-8 in a million-block pool, and only the drawing would err)."""
    return int.from_bytes(value[:8], "little")
NO_COUNTERS = PoolCounters(0, 0.0, 0, 1, 0, 0, 0, 0, 0, 0, {})


def _counter(name: str) -> property:
    return property(lambda mirror: getattr(mirror.counters, name))


def _int_array() -> array:
    return array("q")


@dataclass(slots=True, eq=False)
class MirroredSequence:
    seq_id: str
    request_id: str
    status: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    arrival_time: float
    # Arrays, not lists: a full garbage collection visits every entry of a list (a mirror
    # holds every live token id) but an array's entries not at all.
    block_table: array = field(default_factory=_int_array)
    token_ids: array = field(default_factory=_int_array)

    def info(self) -> SequenceInfo:
        return SequenceInfo(self.seq_id, self.request_id, self.status,
                            tuple(self.block_table), self.num_tokens, self.num_prompt_tokens,
                            self.num_computed_tokens, self.arrival_time)


DEPARTED_KEPT = 64


class PoolMirror:
    """Owned by one reader thread (not thread-safe). `apply` returns False when the
    record cannot be applied (a missed delta, another pool): ask for a new snapshot."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.next_index = 0
        self.awaiting_base = True  # deltas are ignored until a PoolBase arrives
        self.counters = NO_COUNTERS
        self.ref_counts = np.zeros(0, np.int32)
        self.hashed = np.zeros(0, bool)
        # An object array, not a list: the garbage collector does not traverse numpy
        # arrays, and a full collection would visit each of a list's million entries.
        self.hashes = np.full(0, None, object)  # BlockHash | None per block
        # Each hashed block's hash_key and its parent's (has_parent False: a first block),
        # kept with the hashes so the prefix tree links a million blocks in numpy.
        self.hash_keys = np.zeros(0, np.uint64)
        self.parent_keys = np.zeros(0, np.uint64)
        self.has_parent = np.zeros(0, bool)
        # Per block: prefix-cache hits on its content, and when it last joined the back of
        # the eviction order (0: never; the order of cached blocks is by this stamp).
        self.hit_counts = np.zeros(0, np.int64)
        self.free_stamps = np.zeros(0, np.int64)
        self.free_clock = 0
        self.live: dict[str, MirroredSequence] = {}
        # The hashed blocks each of the last DEPARTED_KEPT finished (or aborted) requests
        # held as it left, by request id: the dashboard follows a finished chat turn to
        # its blocks while they stay cached with the same content.
        self.departed: dict[str, tuple[tuple[int, BlockHash], ...]] = {}
        self._holders: HolderIndex | None = None  # built on demand from the block tables
        self.num_covered = 0  # blocks [0, num_covered) hold slice data
        # Bumped by every applied change, so panels can skip what did not move.
        self.blocks_version = 0
        self.sequences_version = 0

    # ---- applying records ----------------------------------------------------------------
    @classmethod
    def of(cls, records) -> "PoolMirror":
        """A new mirror with these records applied (a base and its slices: a snapshot)."""
        mirror = cls()
        for record in records:
            mirror.apply(record)
        return mirror

    def copy(self) -> "PoolMirror":
        """An independent mirror in the same state (O(pool): numpy copies, and the live
        sequences' arrays); the BlockHash objects, immutable, are shared."""
        twin = PoolMirror()
        for name in ("epoch", "next_index", "awaiting_base", "counters", "num_covered",
                     "blocks_version", "sequences_version", "free_clock"):
            setattr(twin, name, getattr(self, name))
        for name in ("ref_counts", "hashed", "hashes", "hash_keys", "parent_keys",
                     "has_parent", "hit_counts", "free_stamps"):
            setattr(twin, name, getattr(self, name).copy())
        twin.departed = dict(self.departed)
        twin.live = {seq_id: MirroredSequence(
            seq.seq_id, seq.request_id, seq.status, seq.num_tokens, seq.num_prompt_tokens,
            seq.num_computed_tokens, seq.arrival_time, array("q", seq.block_table),
            array("q", seq.token_ids)) for seq_id, seq in self.live.items()}
        return twin

    @property
    def ready(self) -> bool:
        return not self.awaiting_base and self.num_covered >= self.num_blocks

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def block_size(self) -> int:
        return self.counters.block_size

    def apply(self, record) -> bool:
        if isinstance(record, PoolBase):
            self._reset(record.epoch, record.counters, covered=0)
            self.next_index = record.index
            for change in record.sequences:
                self._apply_sequence(SequenceChange._make(change))
            self._stamp_freed(record.free_order)
            return True
        if isinstance(record, PoolSlice):
            if record.epoch == self.epoch and not self.awaiting_base:
                self._apply_slice(record)
            return True
        if isinstance(record, PoolDelta):
            return self._apply_delta(record)
        raise TypeError(f"not a pool record: {type(record).__name__}")

    def _reset(self, epoch: int, counters: PoolCounters, covered: int) -> None:
        num_blocks = counters.num_blocks
        self.epoch, self.counters, self.awaiting_base = epoch, counters, False
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.hashed = np.zeros(num_blocks, bool)
        self.hashes = np.full(num_blocks, None, object)
        self.hash_keys = np.zeros(num_blocks, np.uint64)
        self.parent_keys = np.zeros(num_blocks, np.uint64)
        self.has_parent = np.zeros(num_blocks, bool)
        self.hit_counts = np.zeros(num_blocks, np.int64)
        self.free_stamps = np.zeros(num_blocks, np.int64)
        self.free_clock = 0
        self.live, self._holders, self.departed = {}, None, {}
        self.num_covered = min(covered, num_blocks)
        self.blocks_version += 1
        self.sequences_version += 1

    def _apply_slice(self, piece: PoolSlice) -> None:
        start, stop = piece.start, piece.start + len(piece.ref_counts)
        self.ref_counts[start:stop] = piece.ref_counts
        self.hashed[start:stop] = False
        self.hashes[start:stop] = None
        for block_id, block_hash in piece.hashes:
            self._set_hash(block_id, block_hash)
        self.hit_counts[start:stop] = 0
        for block_id, hits in piece.hits:
            self.hit_counts[block_id] = hits
        self.num_covered = max(self.num_covered, stop)
        self.blocks_version += 1

    def _apply_delta(self, delta: PoolDelta) -> bool:
        if self.awaiting_base:
            return True  # the snapshot asked for is on its way
        if delta.epoch != self.epoch:
            if delta.index != 0:
                return False
            self._reset(delta.epoch, delta.counters, covered=delta.counters.num_blocks)
            self.next_index = 0
        if delta.index < self.next_index:
            return True  # already part of the snapshot
        if delta.index > self.next_index:
            return False
        self.next_index += 1
        self.counters = delta.counters
        refs, hashes = self.ref_counts, self.hashes
        for block_id, ref_count, block_hash in delta.blocks:
            refs[block_id] = ref_count
            if hashes[block_id] is not block_hash:  # most touches change the ref only
                self._set_hash(block_id, block_hash)
        for block_id, hits in delta.hits:
            self.hit_counts[block_id] = hits
        self._stamp_freed(delta.freed)
        if delta.blocks:
            self.blocks_version += 1
        for change in delta.sequences:
            self._apply_sequence(SequenceChange._make(change))
        for seq_id in delta.removed:
            if (seq := self.live.pop(seq_id, None)) is not None:
                self._holders = None
                self._keep_departed(seq)
        if delta.sequences or delta.removed:
            self.sequences_version += 1
        return True

    def _keep_departed(self, seq: MirroredSequence) -> None:
        hashes = self.hashes
        kept = tuple((block, hashes[block]) for block in seq.block_table
                     if block >= 0 and hashes[block] is not None)  # < 0: released
        departed = self.departed
        departed[seq.request_id] = departed.pop(seq.request_id, ()) + kept  # newest last
        if len(departed) > DEPARTED_KEPT:
            del departed[next(iter(departed))]

    def cached_blocks_of(self, request_id: str) -> tuple[list[int], int]:
        """(the blocks a departed request held that are still cached with the content it
        left there, how many hashed blocks it held as it left)."""
        held = self.departed.get(request_id, ())
        hashes = self.hashes
        return sorted({block for block, block_hash in held if block < len(hashes)
                       and hashes[block] == block_hash}), len({b for b, _ in held})

    def _stamp_freed(self, block_ids: tuple[int, ...]) -> None:
        """These blocks joined the back of the eviction order, in this order."""
        clock = self.free_clock
        self.free_stamps[list(block_ids)] = np.arange(clock + 1, clock + 1 + len(block_ids))
        self.free_clock = clock + len(block_ids)

    def _set_hash(self, block_id: int, block_hash: BlockHash | None) -> None:
        if self.hashes[block_id] != block_hash:  # by value: a stored log's are new tuples
            self.hit_counts[block_id] = 0  # new content: its hits are yet to come
        self.hashes[block_id] = block_hash
        self.hashed[block_id] = block_hash is not None
        if block_hash is not None:
            value, parent, _ = block_hash
            self.hash_keys[block_id] = hash_key(value)
            self.has_parent[block_id] = parent is not None
            if parent is not None:
                self.parent_keys[block_id] = hash_key(parent)

    def _apply_sequence(self, change: SequenceChange) -> None:
        seq = self.live.get(change.seq_id)
        if seq is None:
            seq = self.live[change.seq_id] = MirroredSequence(
                change.seq_id, change.request_id, change.status, change.num_tokens,
                change.num_prompt_tokens, change.num_computed_tokens, change.arrival_time)
        seq.status, seq.num_tokens = change.status, change.num_tokens
        seq.num_computed_tokens = change.num_computed_tokens
        if change.table_tail or change.table_from < len(seq.block_table):
            self._holders = None
        del seq.block_table[change.table_from:]
        seq.block_table.extend(change.table_tail)
        del seq.token_ids[change.token_from:]
        seq.token_ids.extend(change.new_token_ids)

    # ---- reading: the attributes of an EngineSnapshot, so panels read either ------------
    @property
    def sequences(self) -> list[MirroredSequence]:
        return list(self.live.values())

    # The scalars of the latest delta, under an EngineSnapshot's names.
    config = _counter("config")
    step = _counter("step")
    num_running = _counter("num_running")
    num_waiting = _counter("num_waiting")
    prefix_cache_queries = _counter("prefix_cache_queries")
    prefix_cache_hits = _counter("prefix_cache_hits")
    num_preemptions = _counter("num_preemptions")
    num_evictions = _counter("num_evictions")

    def count(self, state: str) -> int:
        return self.counts()[state]

    @property
    def group_windows(self) -> list[int | None]:
        """Each KV cache group's window (None: full attention). A sequence's block table
        interleaves the groups' tables: entry i * num_groups + g is group g's block for
        position block i (engine.core.kv_cache_manager)."""
        return self.config.get("kv_cache_group_windows") or [None]

    def block_groups(self) -> np.ndarray:
        """Per block, the KV cache group whose table holds it (-1: none)."""
        groups = np.full(self.num_blocks, -1, np.int16)
        num_groups = len(self.group_windows)
        for seq in self.live.values():
            table = np.array(seq.block_table, np.int64)
            held = table >= 0
            groups[table[held]] = (np.arange(len(table)) % num_groups)[held]
        return groups

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests, as /metrics' num_requests_* count them: a request
        runs while any of its sequences does (num_running/num_waiting count sequences,
        and a request with n samples has n of them)."""
        running = {seq.request_id for seq in self.live.values() if seq.status == "running"}
        return len(running), len({seq.request_id for seq in self.live.values()} - running)

    def state_codes(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """0 free, 1 cached (free, still holding a hash), 2 used, 3 shared, per block."""
        refs = self.ref_counts[start:stop]
        codes = np.where(refs > 1, 3, np.where(refs == 1, 2, 0)).astype(np.int8)
        codes[(refs == 0) & self.hashed[start:stop]] = 1
        return codes

    def eviction_order(self) -> np.ndarray:
        """The cached-free blocks, the next one an allocation evicts first (least recently
        used first; plain free blocks are taken before any of them)."""
        cached = np.flatnonzero(self.state_codes() == 1)
        return cached[np.argsort(self.free_stamps[cached], kind="stable")]

    def counts(self) -> dict[str, int]:
        return dict(zip(STATES, np.bincount(self.state_codes(), minlength=4).tolist()))

    def block_tokens(self, block_id: int) -> tuple[int, ...]:
        """What the block holds: its hashed tokens, else the computed tokens a holder put
        there (the longest, if holders computed different amounts)."""
        block_hash = self.hashes[block_id]
        if block_hash is not None:
            return block_hash[2]
        size, best, num_groups = self.block_size, (), len(self.group_windows)
        for seq, index in self.holders(block_id):
            position = index // num_groups
            stored = seq.token_ids[position * size:min((position + 1) * size,
                                                       seq.num_computed_tokens)]
            if len(stored) > len(best):
                best = tuple(stored)
        return best

    def holders(self, block_id: int) -> list[tuple[MirroredSequence, int]]:
        """(sequence, logical index) of every block table entry pointing at the block."""
        if self._holders is None:
            self._holders = HolderIndex.of(self.live.values())
        return self._holders.entries(block_id)

    def block_info(self, block_id: int) -> BlockInfo:
        ref_count = int(self.ref_counts[block_id])
        block_hash = self.hashes[block_id]
        state = STATES[3 if ref_count > 1 else 2 if ref_count == 1 else
                       1 if block_hash is not None else 0]
        owners = tuple(dict.fromkeys(seq.seq_id for seq, _ in self.holders(block_id)))
        value, parent, _ = block_hash or (None, None, None)
        return BlockInfo(block_id, ref_count, state, value.hex() if value else None,
                         parent.hex() if parent else None, self.block_tokens(block_id), owners)

    @property
    def num_used_tokens(self) -> int:
        """Tokens stored in blocks in use (a shared block counted once)."""
        size = self.block_size
        used = self.ref_counts > 0
        total = int(np.count_nonzero(used & self.hashed)) * size
        fill = np.zeros(self.num_blocks, np.int32)
        for seq in self.live.values():
            if not seq.block_table:
                continue
            table = np.array(seq.block_table)  # a copy: a view would pin the array's size
            positions = np.arange(len(table)) // len(self.group_windows)
            stored = np.clip(seq.num_computed_tokens - positions * size, 0, size)
            held = table >= 0  # a sliding window's RELEASED entries (-1) hold no block
            table, stored = table[held], stored[held]
            plain = ~self.hashed[table]
            np.maximum.at(fill, table[plain], stored[plain])
        return total + int(fill[used & ~self.hashed].sum())

    def snapshot(self, replica: int = 0) -> EngineSnapshot:
        """The mirror as a full EngineSnapshot (O(pool): for a reader that asked for one,
        off the engine thread; the pool as of the last delta applied)."""
        counters = self.counters
        return EngineSnapshot(
            counters.time, counters.step, counters.config, self.block_size, self.num_blocks,
            tuple(self.block_info(block_id) for block_id in range(self.num_blocks)),
            tuple(seq.info() for seq in self.live.values()), counters.num_running,
            counters.num_waiting, counters.prefix_cache_queries, counters.prefix_cache_hits,
            counters.num_preemptions, counters.num_evictions, replica)

    @property
    def blocks_released_by_window(self) -> int:
        """Table entries of live sequences whose blocks a sliding window freed (RELEASED,
        -1): what full attention would still hold on top of the blocks in use."""
        return sum(np.count_nonzero(np.array(seq.block_table) < 0)
                   for seq in self.live.values())

    @property
    def blocks_saved_by_sharing(self) -> int:
        held = sum(np.count_nonzero(np.array(seq.block_table) >= 0)
                   for seq in self.live.values())
        return held - int(np.count_nonzero(self.ref_counts > 0))


@dataclass(frozen=True, slots=True)
class HolderIndex:
    """Every block table entry of the live sequences, sorted by block id. Built in numpy
    when a reader asks who holds a block (hover, snapshot) after the tables changed: kept
    current per held block, it would be a Python list per block, and at a million held
    blocks a million objects for every full garbage collection to walk."""

    block_ids: np.ndarray  # sorted
    owners: np.ndarray  # per entry: its sequence's position in `sequences`
    indexes: np.ndarray  # per entry: the logical index in that sequence's block table
    sequences: tuple[MirroredSequence, ...]

    @classmethod
    def of(cls, live) -> "HolderIndex":
        sequences = tuple(seq for seq in live if seq.block_table)
        lengths = np.array([len(seq.block_table) for seq in sequences], np.int64)
        tables = [np.array(seq.block_table) for seq in sequences]
        block_ids = np.concatenate(tables) if tables else np.zeros(0, np.int64)
        owners = np.repeat(np.arange(len(sequences)), lengths)
        indexes = np.arange(len(block_ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        order = np.argsort(block_ids, kind="stable")
        return cls(block_ids[order], owners[order], indexes[order], sequences)

    def entries(self, block_id: int) -> list[tuple[MirroredSequence, int]]:
        start, stop = np.searchsorted(self.block_ids, (block_id, block_id + 1))
        return [(self.sequences[owner], index) for owner, index in
                zip(self.owners[start:stop].tolist(), self.indexes[start:stop].tolist())]


class PoolSource(Protocol):
    """What a PoolReader needs of an engine: its pool feed (every EngineView is one; the
    feed's channel comes from the orchestrator, above telemetry, so it is not named here)."""

    def subscribe_pool(self, maxsize: int = ..., replica: int | None = None) -> Any: ...

    def resync_pool(self, channel: Any) -> None: ...


class PoolReader:
    """A PoolMirror kept current from an engine's pool feed (AsyncEngine.subscribe_pool):
    `update` applies what arrived and asks for a new snapshot after a missed record, so
    a reader never makes the engine thread copy the whole pool at once."""

    def __init__(self, engine: PoolSource, replica: int = 0) -> None:
        self.engine = engine
        self.replica = replica  # which engine replica's pool (engine.replicas.ReplicaSet)
        self.records = engine.subscribe_pool(replica=replica)
        self.mirror = PoolMirror()
        self._dropped = 0
        self._lock = threading.Lock()

    def update(self, first_snapshot_wait_s: float = 5.0,
               history: "PoolHistory | None" = None) -> PoolMirror:
        """The mirror with every record so far applied; while its snapshot is still on
        its way (a few engine-loop turns) wait up to `first_snapshot_wait_s` for it.
        `history` gets every delta applied to a ready mirror."""
        deadline = time.monotonic() + first_snapshot_wait_s
        with self._lock:
            while True:
                for record in self.records.drain():
                    if not self.mirror.apply(record):
                        self._resync()
                        break
                    if history is not None and isinstance(record, PoolDelta) and (
                            self.mirror.ready):
                        history.add(self.mirror, record)
                if self.records.num_dropped != self._dropped:
                    self._dropped = self.records.num_dropped
                    self._resync()
                if self.mirror.ready or time.monotonic() > deadline or self.records.closed:
                    return self.mirror
                time.sleep(0.01)  # the snapshot's slices are on their way

    def _resync(self) -> None:
        self.mirror.awaiting_base = True
        self.engine.resync_pool(self.records)

    def close(self) -> None:
        self.records.close()
