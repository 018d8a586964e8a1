"""The tier's I/O thread: block writes and loads off the engine thread, loads first (a
request waits on them), writes in the order they came."""

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvscope.engine.core.kv_offload.disk_store import DiskStore
from kvscope.engine.core.kv_offload.transfer_sizes import TransferSizes
from kvscope.engine.core.request import BlockHash, Sequence

logger = logging.getLogger(__name__)
# Copies of evicted blocks waiting for the disk, at most: past it a block is not written
# (counted as dropped) rather than host memory growing without bound behind a slow disk.
MAX_WRITE_BACKLOG_BYTES = 1 << 30
LOAD, WRITE, STOP = 0, 1, 2  # queue priorities
# Files a load reads at once: one file's checksum overlaps the next ones' reads (both
# release the GIL), which one reader alone leaves idle.
LOAD_READERS = 4


@dataclass(slots=True)
class LoadJob:
    """A waiting sequence's next prompt blocks held by the tier: per position, each KV cache
    group's key. The I/O thread fills `payloads` (per position, per group) up to the first
    position it could not read whole."""

    seq: Sequence
    block_hashes: list[BlockHash]
    keys: list[list[bytes]]
    payloads: list[list] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class WriteCounts:
    sizes: TransferSizes = field(default_factory=TransferSizes)  # one transfer per block
    seconds: float = 0.0
    errors: int = 0


class TierIO:
    """One daemon thread over a priority queue of jobs; finished loads come back on
    `done_loads` for the engine thread to place in the pool."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self.done_loads: queue.SimpleQueue[LoadJob] = queue.SimpleQueue()
        self.done_writes: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # keys written
        self.written = WriteCounts()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        # key -> payload, queued or being written: a load finds a block here before its file
        # is written
        self._pending: dict[bytes, object] = {}
        self._backlog_bytes = 0
        self._readers = ThreadPoolExecutor(LOAD_READERS, thread_name_prefix="kvscope-kv-tier-read")
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-tier", daemon=True)
        self._thread.start()

    def is_writing(self, key: bytes) -> bool:
        return key in self._pending

    def holds(self, key: bytes) -> bool:
        """In the tier: written, or queued to be."""
        return key in self._pending or key in self.store

    def write(self, key: bytes, payload) -> bool:
        """Queue a block's write; False if the backlog is full (the block is not written)."""
        size = memoryview(payload).nbytes
        with self._lock:
            if key in self._pending:
                return True
            if self._backlog_bytes + size > MAX_WRITE_BACKLOG_BYTES:
                return False
            self._pending[key] = payload
            self._backlog_bytes += size
        self._jobs.put((WRITE, next(self._order), (key, payload)))
        return True

    def load(self, job: LoadJob) -> None:
        self._jobs.put((LOAD, next(self._order), job))

    def drain(self) -> None:
        """Wait until every job queued so far is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finish every queued job, then stop the thread."""
        self._jobs.put((STOP, next(self._order), None))
        self._thread.join()
        self._readers.shutdown()

    def _run(self) -> None:
        while True:
            kind, _, job = self._jobs.get()
            try:
                if kind == STOP:
                    return
                if kind == LOAD:
                    self._load(job)
                else:
                    self._write(*job)
            finally:
                self._jobs.task_done()

    def _write(self, key: bytes, payload) -> None:
        started = time.perf_counter()
        try:
            if self.store.put(key, payload):
                self.done_writes.put(key)
                self.written.sizes.observe(memoryview(payload).nbytes)
        except OSError as error:  # an I/O error: this block is lost to the tier, not the engine
            self.written.errors += 1
            logger.warning("KV tier: writing a block failed (%s); it will be computed when "
                           "needed", error)
        finally:
            self.written.seconds += time.perf_counter() - started
            with self._lock:
                self._backlog_bytes -= memoryview(self._pending.pop(key)).nbytes

    def _read(self, key: bytes):
        with self._lock:
            payload = self._pending.get(key)
        return self.store.get(key) if payload is None else memoryview(payload).cast("B")

    def _load(self, job: LoadJob) -> None:
        started = time.perf_counter()
        try:
            groups = len(job.keys[0])
            read = list(self._readers.map(self._read, [key for keys in job.keys for key in keys]))
            for start in range(0, len(read), groups):
                payloads = read[start:start + groups]
                if any(payload is None for payload in payloads):
                    break  # the blocks after a missing one are of no use to the prefix
                job.payloads.append(payloads)
                job.num_bytes += sum(payload.nbytes for payload in payloads)
        except OSError as error:
            logger.warning("KV tier: reading blocks failed (%s); the rest is computed", error)
        finally:
            job.seconds = time.perf_counter() - started
            self.done_loads.put(job)
