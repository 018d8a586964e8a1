"""Physical KV blocks: ref counts, the LRU free queue and the hash -> block map."""

import gc
import hashlib
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvscope.engine.core.kv_events import (
    BlockRemoved,
    BlocksAllocated,
    BlocksReleased,
    BlocksShared,
    BlockStored,
    KVEventSink,
    discard,
)
from kvscope.engine.core.prefix_misses import BoundedLRU, Eviction
from kvscope.engine.core.request import BlockHash


def hash_block_tokens(parent: bytes | None, token_ids: tuple[int, ...],
                      cache_salt: str | None = None) -> bytes:
    """Stable across processes (unlike Python's salted hash): sha256 of parent + tokens.
    A request's cache_salt (vLLM's) is mixed into its first block's hash, so prompts under
    different salts never share a prefix (every later block chains to the first)."""
    digest = hashlib.sha256(parent or b"root")
    if cache_salt is not None:
        salt = cache_salt.encode()
        digest.update(b"salt" + struct.pack("<q", len(salt)) + salt)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()[:16]


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The identity of a block's content in KV cache group `group` (engine.core.kv_groups):
    the same tokens hold other layers' K/V in another group, so each group's blocks are
    cached under their own hashes (vLLM keys its cache by hash and group id). Group 0 keeps
    the tokens' own hash, and each group's hashes chain to that group's parents."""
    if group == 0:
        return block_hash
    value, parent, token_ids = block_hash
    tag = group.to_bytes(2, "little")
    return (hashlib.sha256(value + tag).digest()[:16],
            None if parent is None else hashlib.sha256(parent + tag).digest()[:16], token_ids)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block; the prev/next links thread it through the free queue."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV cache group whose content block_hash names
    num_hits: int = 0  # prefix-cache hits on this content (forgotten with it)
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from anywhere (a cache hit).

    Plain free blocks sit at the front, cached-free blocks join at the back, so
    allocation takes plain blocks first and then evicts the least recently used cached one.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)  # sentinels: no None checks at the ends
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self.tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self.head, block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.prev_free, block.next_free = anchor, anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All physical blocks. Each is free, cached-free (hash, ref 0, queued) or used (ref >= 1).

    Every change is reported to `emit` (engine.core.kv_events) as it happens.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 emit: KVEventSink = discard) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        with _collector_paused():
            self.blocks = [KVBlock(i) for i in range(num_blocks)]
            self.free_queue = FreeBlockQueue(self.blocks)
        # hash value -> block id. Ids, not blocks: a dict of bytes and ints is one the
        # garbage collector never tracks, where a full collection would walk every entry
        # of a map to block objects (docs/performance-history.md, 'Figures the code's
        # comments quoted').
        self.cached_blocks: dict[bytes, int] = {}
        # Kept up to date on every transition, so reading the counts never scans the pool.
        self.num_cached_free_blocks = 0
        self.num_evictions = 0
        # Bounded memory of content no longer here, to explain prefix misses
        # (engine.core.prefix_misses): evicted hash value -> who evicted it, and a cached
        # block's parent hash value (None: the first block) -> the tokens it held.
        self.evicted: BoundedLRU[bytes, Eviction] = BoundedLRU()
        self.followers: BoundedLRU[bytes | None, tuple[int, ...]] = BoundedLRU()
        # And a cached first block's unsalted hash value -> (the cache_salt it was cached
        # under,), which the cache manager records: the pool never sees salts.
        self.first_block_salts: BoundedLRU[bytes, tuple[str | None]] = BoundedLRU()
        self.emit = emit

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: plain free plus evictable cached-free."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, count: int, evictor: Eviction | None = None) -> list[KVBlock]:
        """Take `count` free blocks; `evictor` (who asks, and when) is remembered against
        each cached block whose content this evicts."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if evictor is not None and block.block_hash is not None:
                self.evicted.put(block.block_hash[0], evictor)
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        self.emit(BlocksAllocated(tuple(block.block_id for block in blocks)))
        return blocks

    def share(self, blocks: Iterable[KVBlock], prefix_hit: bool = False) -> None:
        """Add a reference to each block, reviving cached-free ones out of the free queue;
        `prefix_hit`: a prompt found them in the prefix cache (not a fork), so each counts
        a hit."""
        block_ids = []
        for block in blocks:
            block.num_hits += prefix_hit
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= block.block_hash is not None
            block.ref_count += 1
            block_ids.append(block.block_id)
        if block_ids:
            self.emit(BlocksShared(tuple(block_ids)))

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; a block reaching zero rejoins the free queue.

        Callers pass a sequence's blocks tail first, so a sequence's later blocks
        (less likely to be shared by future prompts) are evicted before its earlier ones.
        """
        block_ids = []
        for block in blocks:
            block.ref_count -= 1
            block_ids.append(block.block_id)
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free_blocks += 1
        if block_ids:
            self.emit(BlocksReleased(tuple(block_ids)))

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...],
               parent: bytes | None = None) -> KVBlock | None:
        """The cached block with this hash, but only if it truly holds these tokens after
        this parent (a hash collision must not hand out another prefix's KV)."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.block_hash[1:] == (parent, token_ids) else None

    def cache(self, block: KVBlock, block_hash: BlockHash, group: int) -> None:
        """Mark a full block as holding this content (group_block_hash's, for KV cache
        group `group`), findable by later prompts."""
        # An equal block cached earlier stays the one found; this one stays a plain block.
        value = block_hash[0]
        if not self.enable_caching or value in self.cached_blocks:
            return
        block.block_hash = block_hash
        block.group = group
        self.cached_blocks[value] = block.block_id
        if group == 0:
            self.followers.put(block_hash[1], block_hash[2])
        self.emit(BlockStored(block.block_id, block_hash, group))

    def _evict(self, block: KVBlock) -> None:
        """Forget a cached-free block's content (it is being reused or reset)."""
        block_hash = block.block_hash
        if block_hash is None:
            return
        del self.cached_blocks[block_hash[0]]
        block.block_hash = None
        block.num_hits = 0
        self.num_cached_free_blocks -= 1
        self.num_evictions += 1
        self.emit(BlockRemoved(block.block_id, block_hash, block.group))

    def cached_free_order(self) -> list[int]:
        """The cached-free blocks in the order allocation evicts them (least recently used
        first): they sit behind the plain free blocks, at the free queue's back (the head
        sentinel, unhashed, ends the walk). O(them)."""
        order = []
        block = self.free_queue.tail.prev_free
        while block.block_hash is not None:
            order.append(block.block_id)
            block = block.prev_free
        return order[::-1]

    def reset_cache(self) -> None:
        """Forget every cached-free block's content (used blocks keep theirs)."""
        for block in list(self.free_queue):
            if block.block_hash is not None:
                self._evict(block)
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: building a pool allocates one tracked object per
    block, and each collection its allocations trigger walks the blocks built so far, so a
    1M-block pool took several times longer to build with collections than without (the
    blocks are all alive; a collection could free none of them; docs/performance-history.md,
    'Replay')."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
