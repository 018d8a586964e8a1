"""A disk tier under the simulated pool: the what-if "with an N GB tier?" of a replay.

The tier is the engine's own KVTier (engine.core.kv_offload.tier): the same eviction hook,
the same prefix lookup that takes a waiting prompt out of the queue while its blocks load,
the same placement in the pool. What it stands on is simulated: the store is an LRU of
block keys and sizes within the tier's size (nothing is written), the blocks are sizes
(the simulator has no KV tensors), and a load finishes on the replay's clock, its bytes
over the load bandwidth after the previous load finished (one disk, loads in turn). A
write lands at once: the real tier writes on its own thread, off the engine's path.
"""

import heapq
import itertools
import queue
from collections import OrderedDict
from dataclasses import dataclass

from kvscope.engine.core.kv_offload.io_thread import LoadJob, WriteCounts
from kvscope.engine.core.kv_offload.tier import KVTier

GIB = 1 << 30
# The real tier's load rate on the 2-core AMD EPYC's virtual disk (bench/kv_tiers.py:
# 308-335 MB/s; docs/performance-history.md, 'The disk tier below the pool').
DEFAULT_LOAD_GBPS = 0.3


@dataclass(frozen=True, slots=True)
class TierWhatIf:
    """The simulated tier: its size (GiB, as kv_offload_gb) and how fast it loads (GB/s)."""

    size_gb: float
    load_gbps: float = DEFAULT_LOAD_GBPS

    def __post_init__(self) -> None:
        if not self.size_gb > 0:
            raise ValueError(f"kv_offload_gb={self.size_gb!r} must be > 0")
        if not self.load_gbps > 0:
            raise ValueError(f"kv_offload_gbps={self.load_gbps!r} must be > 0")

    @property
    def label(self) -> str:
        return f"{self.size_gb:g} GiB disk tier (simulated, {self.load_gbps:g} GB/s)"


@dataclass(frozen=True, slots=True)
class BlockBytes:
    """A pool block as the simulator copies it out: only its size."""

    nbytes: int


class SimulatedBlocks:
    """The KVBlockIO of a pool with no tensors behind it."""

    def __init__(self, bytes_per_block: int) -> None:
        self.block = BlockBytes(bytes_per_block)

    def read_kv_blocks(self, block_ids: list[int]) -> list[BlockBytes]:
        return [self.block] * len(block_ids)

    def write_kv_blocks(self, block_ids: list[int], payloads: list) -> None:
        """Nothing to write into."""


class SimulatedStore:
    """DiskStore's bookkeeping without the disk: block keys and sizes, least recently used
    first, evicted to stay within the capacity."""

    full_disk = None  # a simulated disk never fills

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self.num_bytes = 0
        self.removed: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def key(self, block_hash: bytes) -> bytes:
        return block_hash  # one model per simulation: no fingerprint to salt with

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def put(self, key: bytes, size: int) -> bool:
        if key in self._index or size > self.capacity_bytes:
            return False
        while self.num_bytes + size > self.capacity_bytes:
            evicted, evicted_size = self._index.popitem(last=False)
            self.num_bytes -= evicted_size
            self.removed.put(evicted)
        self._index[key] = size
        self.num_bytes += size
        return True

    def touch(self, key: bytes) -> int | None:
        """The block's size, now most recently used; None if not held."""
        size = self._index.get(key)
        if size is not None:
            self._index.move_to_end(key)
        return size


class FinishedLoads:
    """TierIO.done_loads on the replay's clock: a load is done once the clock reaches its
    finish; waiting for one (`block`, the engine has nothing else to run) moves the clock
    there."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self._loads: list[tuple[float, int, LoadJob]] = []  # (finish, order, job), a heap
        self._order = itertools.count()

    def add(self, finish_s: float, job: LoadJob) -> None:
        heapq.heappush(self._loads, (finish_s, next(self._order), job))

    def get(self, block: bool = True) -> LoadJob:
        if self._loads and (block or self._loads[0][0] <= self.clock.now):
            finish_s, _, job = heapq.heappop(self._loads)
            if finish_s > self.clock.now:
                self.clock.idle_until(finish_s)
            return job
        raise queue.Empty


class SimulatedTierIO:
    """TierIO's interface over a SimulatedStore, timed on the replay's clock."""

    def __init__(self, store: SimulatedStore, clock, load_bytes_per_s: float) -> None:
        self.store = store
        self.clock = clock
        self.load_bytes_per_s = load_bytes_per_s
        self.done_loads = FinishedLoads(clock)
        self.done_writes: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.written = WriteCounts()
        self._disk_free_s = 0.0  # when the loads queued so far are done

    def is_writing(self, key: bytes) -> bool:
        return False  # a write lands at once

    def holds(self, key: bytes) -> bool:
        return key in self.store

    def write(self, key: bytes, payload: BlockBytes) -> bool:
        if self.store.put(key, payload.nbytes):
            self.done_writes.put(key)
            self.written.sizes.observe(payload.nbytes)
        return True

    def load(self, job: LoadJob) -> None:
        """The job's blocks up to the first the store lost, done after their bytes' time."""
        for keys in job.keys:
            sizes = [self.store.touch(key) for key in keys]
            if None in sizes:
                break
            job.payloads.append([BlockBytes(size) for size in sizes])
            job.num_bytes += sum(sizes)
        job.seconds = job.num_bytes / self.load_bytes_per_s
        self._disk_free_s = max(self._disk_free_s, self.clock.now) + job.seconds
        self.done_loads.add(self._disk_free_s, job)

    def drain(self) -> None:
        """Nothing is ever queued: writes land at once, loads are on the clock."""

    def close(self) -> None:
        """No thread to stop."""


def simulated_tier(core, clock, what_if: TierWhatIf) -> KVTier:
    """The what-if tier for a simulated EngineCore (attach it with core.attach_kv_tier)."""
    store = SimulatedStore(int(what_if.size_gb * GIB))
    config = core.config
    blocks = SimulatedBlocks(core.runner.bytes_per_block(config.block_size,
                                                         config.kv_cache_dtype))
    io = SimulatedTierIO(store, clock, what_if.load_gbps * 1e9)
    return KVTier(store, core.kv_cache, blocks, core.events.emit, io)
