"""The tier's directory: one folder per fingerprint, one file per block, an index of them
rebuilt from the folder at start, evicted least recently used within the size.

Processes may share the directory: every file appears by an atomic rename of a temporary
file no one else names, and every read checks the whole file, so the worst another process
can do is delete a file this one indexed (a miss, not a wrong block).
"""

import errno
import hashlib
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.core.kv_offload.block_file import (
    HEADER,
    SUFFIX,
    TMP_SUFFIX,
    CorruptBlockFile,
    block_file_name,
    read_block_file,
    tmp_file_pid,
    write_block_file,
)

logger = logging.getLogger(__name__)
GiB = 1 << 30
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class ForeignTier:
    """A folder of the directory written under another fingerprint: never read."""

    fingerprint: str
    num_files: int
    num_bytes: int


class DiskStore:
    """Block files under `root / fingerprint`, at most `capacity_bytes` of them.

    Keys are the prefix cache's block hashes salted with the fingerprint, so a file can only
    ever be found by an engine whose KV it holds. Thread-safe: the engine thread asks what
    is held, the tier's I/O thread writes, reads, evicts and deletes.
    """

    def __init__(self, root: Path, fingerprint: str, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.fingerprint_bytes = bytes.fromhex(fingerprint)
        self.folder = self.root / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self.num_bytes = 0
        self.num_corrupt_deleted = 0
        self.num_evicted = 0
        self.full_disk: str | None = None  # why writes stopped, once they did
        self.removed: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # keys dropped since
        self._rebuild_index()

    def key(self, block_hash: bytes) -> bytes:
        return hashlib.sha256(self.fingerprint_bytes + block_hash).digest()[:16]

    def _rebuild_index(self) -> None:
        """Index the folder's block files, oldest use first; delete temporary files whose
        writer is dead (a crash mid-write) and files too short to hold a header."""
        entries = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(TMP_SUFFIX):
                pid = tmp_file_pid(entry.name)
                if pid is None or not _alive(pid):
                    _unlink(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                stat = entry.stat()
                key = bytes.fromhex(entry.name.removesuffix(SUFFIX))
            except (OSError, ValueError):
                continue
            if stat.st_size < HEADER.size or len(key) != 16:
                _unlink(entry.path)
                self.num_corrupt_deleted += 1
                continue
            entries.append((stat.st_atime_ns, key, stat.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self.num_bytes += size
        self._evict_to(self.capacity_bytes)

    # ---- what the engine thread asks ----------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        """The blocks held, least recently used first."""
        with self._lock:
            return list(self._index)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    # ---- what the I/O thread does -------------------------------------------------------
    def put(self, key: bytes, payload) -> bool:
        """Write a block unless held already or writes stopped; True if written."""
        if self.full_disk is not None or key in self._index:
            return False
        size = HEADER.size + memoryview(payload).nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._evict_to(self.capacity_bytes - size)
        try:
            size = write_block_file(self.folder, self.fingerprint_bytes, key, payload)
        except OSError as error:
            if error.errno not in FULL_DISK_ERRNOS:
                raise
            self.full_disk = f"{self.folder}: {error.strerror}"
            logger.warning("KV tier: the disk is full (%s): the tier stops writing; the engine "
                           "keeps serving, and reads what the tier holds", self.full_disk)
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.num_bytes += size
        return True

    def get(self, key: bytes):
        """The block's payload, or None if it is not held, gone or corrupt (then deleted)."""
        if key not in self._index:
            return None
        path = self.folder / block_file_name(key)
        try:
            payload = read_block_file(path, self.fingerprint_bytes, key)
        except FileNotFoundError:  # another process evicted it
            self._forget(key)
            self.removed.put(key)
            return None
        except CorruptBlockFile as error:
            logger.warning("KV tier: %s; deleted, the block will be computed", error)
            _unlink(path)
            self._forget(key)
            self.removed.put(key)
            self.num_corrupt_deleted += 1
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.num_bytes -= size

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used files until the tier holds at most `limit` bytes."""
        while self._index and self.num_bytes > max(limit, 0):
            key, size = self._index.popitem(last=False)
            self.num_bytes -= size
            self.num_evicted += 1
            self.removed.put(key)
            _unlink(self.folder / block_file_name(key))

    # ---- other fingerprints -------------------------------------------------------------
    def foreign_tiers(self) -> list[ForeignTier]:
        """Folders of other fingerprints in the directory (another model, dtype, block size,
        rope or cache layout): reported, never read."""
        found = []
        for entry in os.scandir(self.root):
            if entry.is_dir() and entry.name != self.fingerprint and _is_fingerprint(entry.name):
                sizes = [f.stat().st_size for f in os.scandir(entry.path) if f.is_file()]
                found.append(ForeignTier(entry.name, len(sizes), sum(sizes)))
        return found

    def prune_foreign(self) -> int:
        """Delete the other fingerprints' folders; returns the bytes freed."""
        freed = 0
        for tier in self.foreign_tiers():
            shutil.rmtree(self.root / tier.fingerprint, ignore_errors=True)
            freed += tier.num_bytes
        return freed


def open_disk_store(path: str, size_gb: float, fingerprint: str) -> DiskStore | None:
    """The store at `path`, or None with a warning naming the setting when the directory
    cannot be used (the engine then runs without the tier). A size larger than the free
    disk is capped to what is free, with a warning."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}{TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        logger.warning("kv_offload_dir=%r is not a writable directory (%s): the engine runs "
                       "without the disk tier", path, error.strerror or error)
        return None
    capacity = int(size_gb * GiB)
    store = DiskStore(root, fingerprint, capacity)
    available = shutil.disk_usage(root).free + store.num_bytes
    if capacity > available:
        logger.warning("kv_offload_gb=%g is larger than the free disk at %s (%.2f GiB with "
                       "what the tier holds): the tier is capped at that", size_gb, root,
                       available / GiB)
        store.capacity_bytes = available
    for tier in store.foreign_tiers():
        logger.warning("kv_offload_dir=%r holds %d files (%.1f MiB) of another fingerprint "
                       "(%s: another model or KV layout): never read; DiskStore.prune_foreign "
                       "deletes them", path, tier.num_files, tier.num_bytes / (1 << 20),
                       tier.fingerprint)
    return store


def _is_fingerprint(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
