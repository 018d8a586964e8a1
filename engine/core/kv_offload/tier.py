"""KVTier: the engine thread's side of the disk tier.

- **Save.** A block the pool evicts (BlockRemoved) still holds its K/V until the step that
  reuses it runs; `sync`, called right before each launch's block moves and forward,
  copies such blocks out and hands the copies to the I/O thread.
- **Load.** A waiting sequence whose next prompt blocks the tier holds is taken out of the
  queue (`fetch`, the scheduler's hook) while the I/O thread reads them; other requests
  run meanwhile. `receive`, before each schedule, places what was read in the pool as
  cached-free blocks (their bytes go in at the next `sync`) and returns the sequences to
  the front of the queue, where the prefix cache now finds those blocks.

Block bytes live in the worker's KV tensors; the tier reaches them only through the
KVBlockIO the engine hands it.
"""

import logging
import queue
from dataclasses import dataclass, field
from typing import Protocol

from kvscope.engine.core.block_pool import group_block_hash
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import (
    BlockRemoved,
    KVEvent,
    KVEventSink,
    TierBlockRemoved,
    TierBlockStored,
    discard,
)
from kvscope.engine.core.kv_offload.disk_store import DiskStore
from kvscope.engine.core.kv_offload.io_thread import LoadJob, TierIO
from kvscope.engine.core.kv_offload.transfer_sizes import TransferSizes
from kvscope.engine.core.prefix_misses import Eviction
from kvscope.engine.core.request import BlockHash, Sequence

logger = logging.getLogger(__name__)


class KVBlockIO(Protocol):
    """The bytes of whole pool blocks (every layer's K and V), as the worker holds them."""

    def read_kv_blocks(self, block_ids: list[int]) -> list: ...

    def write_kv_blocks(self, block_ids: list[int], payloads: list) -> None: ...


@dataclass(slots=True)
class TierStats:
    """Counted since the engine started; tokens as vLLM counts its external prefix cache."""

    queries: int = 0  # prompt tokens past the pool's prefix asked of the tier
    hits: int = 0  # of those, tokens loaded into the pool
    blocks_loaded: int = 0
    load_sizes: TransferSizes = field(default_factory=TransferSizes)  # bytes placed per load
    load_seconds: float = 0.0  # the I/O thread's time reading them
    loads: int = 0
    writes_dropped: int = 0  # evicted blocks not written: the write backlog was full
    blocks_stored: int = 0  # written, as the engine thread learned it
    blocks_removed: int = 0  # pruned to stay within the size (or found corrupt)

    @property
    def bytes_loaded(self) -> int:
        return self.load_sizes.num_bytes


@dataclass(slots=True)
class TierTotals:
    """The tier's counters under vLLM's names: prompt tokens asked of it and found there
    (vllm:external_prefix_cache_*), and bytes, seconds and transfers by size moved per
    transfer type (vllm:kv_offload_total_bytes / _time, vllm:kv_offload_size; "GPU" is the
    pool, as vLLM's KV events name it)."""

    queries: int = 0
    hits: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, TransferSizes] = field(default_factory=dict)
    loads: int = 0  # prefix loads, each one job of the I/O thread


MEDIUM = "DISK"  # vLLM's KV events' medium field; the pool is "GPU"
FLUSH_CHUNK_BLOCKS = 256
POOL_TO_DISK, DISK_TO_POOL = f"GPU_to_{MEDIUM}", f"{MEDIUM}_to_GPU"


class KVTier:
    def __init__(self, store: DiskStore, kv_cache: KVCacheManager, blocks: KVBlockIO,
                 emit: KVEventSink = discard, io: TierIO | None = None) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self.pool = kv_cache.pool
        self.blocks = blocks
        self.emit = emit  # TierBlockStored / TierBlockRemoved, on the engine thread
        # The store's I/O thread; the replay's simulator passes its own (engine.replay).
        self.io = io if io is not None else TierIO(store)
        self.stats = TierStats()
        self._to_save: dict[int, tuple[bytes, BlockHash, int]] = {}  # block id -> key, hash, group
        # What this engine wrote and the tier still holds, for its events: key -> hash, group
        self._written: dict[bytes, tuple[BlockHash, int]] = {}
        self._to_fill: dict[int, object] = {}  # block id -> the payload loaded for it
        self._num_loading = 0
        self._counted_at_step = self._step_totals()  # at the previous step_counts()

    # ---- save ----------------------------------------------------------------------------
    def observe(self, event: KVEvent) -> None:
        """The pool's events: each eviction is a block to save (EventBus listener)."""
        if isinstance(event, BlockRemoved):
            if self._to_fill.pop(event.block_id, None) is not None:
                return  # placed by a load and evicted before its bytes went in: the tier has it
            key = self.store.key(event.block_hash[0])
            if (key not in self.store and not self.io.is_writing(key)
                    and self.store.full_disk is None):
                self._to_save[event.block_id] = (key, event.block_hash, event.group)

    def forget_pending(self) -> None:
        """The KV tensors were replaced: the evicted blocks' bytes are gone."""
        self._to_save.clear()
        self._to_fill.clear()

    def sync(self) -> None:
        """Before a launch's block moves and forward: evicted blocks out (their new owners
        write them next), loaded blocks in."""
        if self._to_save:
            block_ids = list(self._to_save)
            for block_id, payload in zip(block_ids, self.blocks.read_kv_blocks(block_ids)):
                key, block_hash, group = self._to_save[block_id]
                if self.io.write(key, payload):
                    self._written[key] = (block_hash, group)
                else:
                    self.stats.writes_dropped += 1
            self._to_save.clear()
        if self._to_fill:
            self.blocks.write_kv_blocks(list(self._to_fill), list(self._to_fill.values()))
            self._to_fill.clear()

    # ---- load ----------------------------------------------------------------------------
    def fetch(self, seq: Sequence, num_pool_blocks: int) -> bool:
        """True if the tier starts loading blocks past the `num_pool_blocks` the pool holds
        of this waiting sequence's prompt: it leaves the queue until `receive` gives it
        back."""
        if seq.num_computed_tokens or seq.request.params.prompt_logprobs is not None:
            return False
        hashes = self.kv_cache.prompt_block_hashes(seq)[num_pool_blocks:]
        keys = []
        for block_hash in hashes:
            position = [self.store.key(group_block_hash(block_hash, group)[0])
                        for group in range(self.kv_cache.num_groups)]
            if not all(self.io.holds(key) for key in position):
                break
            keys.append(position)
        self.stats.queries += len(hashes) * self.kv_cache.block_size
        if not keys:
            return False
        self.io.load(LoadJob(seq, hashes[:len(keys)], keys))
        self._num_loading += 1
        return True

    @property
    def num_loading(self) -> int:
        return self._num_loading

    def receive(self, wait: bool = False) -> list[Sequence]:
        """Place finished loads in the pool; the sequences to requeue first, in the order
        their loads finished. `wait`: nothing else can run, so wait for one load."""
        self._report_changes()
        ready = []
        while self._num_loading:
            try:
                job = self.io.done_loads.get(block=wait and not ready)
            except queue.Empty:
                break
            self._num_loading -= 1
            self._place(job)
            if not job.seq.is_finished:  # aborted while loading: its blocks stay cached
                ready.append(job.seq)
        return ready

    def _report_changes(self) -> None:
        """The writes and removals the I/O thread finished, as events (engine thread)."""
        stored, removed = _drain(self.io.done_writes), _drain(self.store.removed)
        self.stats.blocks_stored += len(stored)
        self.stats.blocks_removed += len(removed)
        for key in stored:
            if key in self._written:
                self.emit(TierBlockStored(*self._written[key], MEDIUM))
        for key in removed:
            if key in self._written:
                self.emit(TierBlockRemoved(*self._written.pop(key), MEDIUM))

    def _place(self, job: LoadJob) -> None:
        """The loaded blocks as cached-free blocks, most recently used, prefix last in line
        for eviction; as many positions as free blocks allow."""
        groups = self.kv_cache.num_groups
        count = min(len(job.payloads), self.pool.num_free_blocks // groups)
        self.stats.loads += 1
        self.stats.load_seconds += job.seconds
        if count == 0:
            self.stats.load_sizes.observe(0)  # a transfer all the same: it was read
            return
        # What the pool still holds of the prefix must outlive the allocation below, which
        # evicts least recently used blocks first.
        held = [block for blocks in self.kv_cache.find_cached_prefix(job.seq)
                for block in blocks if block is not None]
        self.pool.share(held)
        count = min(count, self.pool.num_free_blocks // groups)
        blocks = self.pool.allocate(count * groups,
                                    Eviction(job.seq.request.request_id, self.kv_cache.step))
        placed, placed_bytes = iter(blocks), 0
        for block_hash, payloads in zip(job.block_hashes[:count], job.payloads[:count]):
            for group, payload in enumerate(payloads):
                block = next(placed)
                self.pool.cache(block, group_block_hash(block_hash, group), group)
                if block.block_hash is not None:  # not already cached by another block
                    self._to_fill[block.block_id] = payload
                    self.stats.blocks_loaded += 1
                    placed_bytes += payload.nbytes
        self.pool.release(reversed(blocks))
        self.pool.release(reversed(held))
        self.stats.hits += count * self.kv_cache.block_size
        self.stats.load_sizes.observe(placed_bytes)

    def totals(self) -> TierTotals:
        # One copy of the write sizes (the I/O thread adds to them), so bytes and sizes agree.
        sizes = {POOL_TO_DISK: self.io.written.sizes.copy(),
                 DISK_TO_POOL: self.stats.load_sizes.copy()}
        return TierTotals(self.stats.queries, self.stats.hits,
                          {kind: counted.num_bytes for kind, counted in sizes.items()},
                          {POOL_TO_DISK: self.io.written.seconds,
                           DISK_TO_POOL: self.stats.load_seconds},
                          sizes, self.stats.loads)

    def step_counts(self) -> tuple[int, ...]:
        """What the tier holds now, then what it counted since the previous call (once per
        engine step: telemetry's TierStep)."""
        now = self._step_totals()
        before, self._counted_at_step = self._counted_at_step, now
        return (self.store.num_blocks, self.store.num_bytes,
                *(after - earlier for after, earlier in zip(now, before, strict=True)))

    def _step_totals(self) -> tuple[int, ...]:
        """The engine thread's own counters, in TierStep's order past the two held ones."""
        stats = self.stats
        return (stats.blocks_stored, stats.blocks_removed, stats.blocks_loaded,
                stats.bytes_loaded, stats.loads, stats.queries, stats.hits)

    # ---- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Save every cached block the tier lacks (so a restart finds them), finish the
        queued writes and stop the I/O thread."""
        self.flush()
        self.stop()

    def stop(self) -> None:
        """Finish the queued writes (their bytes are copied already) and stop the I/O
        thread; the pool's blocks are not read again."""
        self.io.close()
        self._report_changes()

    def flush(self) -> None:
        """Write every cached block the tier lacks, and wait until they are on disk (a
        tier opened on the directory next, by a restart or a reconfigure, indexes them)."""
        lacking = []
        for block_id in self.pool.cached_blocks.values():
            block = self.pool.blocks[block_id]
            key = self.store.key(block.block_hash[0])
            if (block_id not in self._to_fill and key not in self.store
                    and not self.io.is_writing(key) and self.store.full_disk is None):
                lacking.append((block_id, (key, block.block_hash, block.group)))
        self.sync()
        # A chunk at a time: a large pool's copies would not fit the write backlog at once.
        for start in range(0, len(lacking), FLUSH_CHUNK_BLOCKS):
            self._to_save.update(lacking[start:start + FLUSH_CHUNK_BLOCKS])
            self.sync()
            self.io.drain()


def _drain(channel: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(channel.get_nowait())
        except queue.Empty:
            return items
