"""Per-sequence block allocation over the KV cache groups, prefix-cache lookup,
copy-on-write, sharing stats, and the freeing of blocks that leave a sliding window."""

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import takewhile

from kvscope.engine.core.block_pool import (
    BlockPool,
    KVBlock,
    group_block_hash,
    hash_block_tokens,
)
from kvscope.engine.core.kv_events import (
    BlockTableChanged,
    KVEventSink,
    MissReason,
    PrefixMiss,
    discard,
)
from kvscope.engine.core.prefix_misses import Eviction, common_length
from kvscope.engine.core.request import BlockHash, Sequence
from kvscope.engine.core.state_slots import StateSlots


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in tokens, as vLLM does: queried prompt tokens and those found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class SwapStats:
    swap_outs: int = 0
    swap_ins: int = 0
    blocks_out: int = 0
    blocks_in: int = 0


# A block table entry whose block fell wholly out of the sliding window and was freed.
RELEASED = -1


class KVCacheManager:
    """Gives each sequence the blocks it needs, sharing cached and forked blocks; reports
    each block table change (and, through its pool, each block change) to `emit`.

    group_windows: each KV cache group's window (engine.core.kv_groups; None: full
    attention). A sequence has one block table per group, kept interleaved by position in
    `seq.block_table`: entry i * num_groups + g is group g's block for tokens
    [i * block_size, (i + 1) * block_size) (one group: the plain table). Every group
    allocates a block per position; a sliding group (window W) frees its blocks wholly
    before the window of the sequence's next token while the sequence runs, their entries
    becoming RELEASED, so it holds at most ceil(W / block_size) + 1 blocks while the
    sequence decodes; full groups keep every block (docs/architecture.md, "Sliding
    windows").

    num_state_slots > 0: the model has recurrent layers, and a sequence holds one state
    slot (engine.core.state_slots) whenever it holds blocks; such a model runs without
    swapping (a swapped block would lack its state). With prefix caching, the state is
    snapshot where a sequence's computed tokens reach a multiple of
    `snapshot_every_n_blocks` blocks, and a prefix hit ends on a snapshot, which the new
    sequence's slot starts from.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, emit: KVEventSink = discard,
                 group_windows: Iterable[int | None] = (None,),
                 num_state_slots: int = 0, snapshot_every_n_blocks: int = 8) -> None:
        group_windows = tuple(group_windows)
        if num_state_slots and num_swap_blocks:
            raise ValueError("num_state_slots: recurrent state slots need num_swap_blocks=0 "
                             "(a swapped block lacks the state)")
        windows = {window for window in group_windows if window is not None}
        if not group_windows or len(windows) > 1:
            raise ValueError(f"group_windows: one or more groups sharing at most one sliding "
                             f"window, got {list(group_windows)}")
        self.block_size = block_size
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self.sliding_window = windows.pop() if windows else None  # every sliding group's
        self.sliding_groups = [g for g, window in enumerate(group_windows) if window is not None]
        self.enable_caching = enable_caching
        self.emit = emit
        self.pool = BlockPool(num_blocks, enable_caching, emit)
        self.prefix_stats = PrefixCacheStats()
        # The CPU swap pool: block ids not holding a swapped-out sequence's K/V.
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks = list(range(num_swap_blocks))
        self.swap_stats = SwapStats()
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshot_tokens = snapshot_every_n_blocks * block_size  # a snapshot's spacing
        # The engine step the allocations being made are for (the engine core sets it
        # before each schedule): an eviction remembers it (engine.core.prefix_misses).
        self.step = 0

    def blocks_needed(self, num_tokens: int) -> int:
        """Positions (blocks per group) that num_tokens tokens fill."""
        return -(-num_tokens // self.block_size)

    def pool_blocks_needed(self, num_tokens: int) -> int:
        """Pool blocks a sequence of num_tokens tokens holds with no block freed yet."""
        return self.blocks_needed(num_tokens) * self.num_groups

    def group_table(self, seq: Sequence, group: int) -> list[int]:
        """Group `group`'s block table of the sequence (RELEASED where a window freed one)."""
        return seq.block_table[group::self.num_groups]

    def first_kept_block(self, num_computed: int) -> int:
        """The first position a sliding group still needs for a sequence with
        `num_computed` tokens: the token at position num_computed sees keys
        (num_computed - W, num_computed]."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def held_blocks(self, table: list[int]) -> list[KVBlock]:
        """The blocks a table holds (its RELEASED entries hold none)."""
        return [self.pool.blocks[i] for i in table if i != RELEASED]

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free the sliding groups' blocks wholly before the window of the sequence's next
        token (seq.num_released_blocks counts the positions already freed).

        They were hashed when they filled (cache_full_blocks), so with prefix caching they
        join the cached-free queue's tail in position order, behind the blocks freed
        before them: a later prompt with the same prefix still finds them until they are
        evicted, oldest first.
        """
        if not self.sliding_groups:
            return
        start = seq.num_released_blocks
        end = min(self.first_kept_block(seq.num_computed_tokens),
                  len(seq.block_table) // self.num_groups)
        if end <= start:
            return
        table, released = seq.block_table, []
        for position in range(start, end):
            for group in self.sliding_groups:
                index = position * self.num_groups + group
                released.append(table[index])
                table[index] = RELEASED
        seq.num_released_blocks = end
        self.emit(BlockTableChanged(seq, start * self.num_groups))
        self.pool.release(self.pool.blocks[i] for i in released)

    def find_cached_prefix(self, seq: Sequence) -> list[tuple[KVBlock | None, ...]]:
        """The longest prefix of the sequence's tokens whose K/V the cache holds: per
        position, each group's block.

        At most (num_tokens - 1) tokens are reused, so one token is always computed
        and produces the logits to sample from. A full group must have every block of the
        prefix cached; a sliding group only the blocks the next token's window sees
        (vLLM's SlidingWindowManager rule, and its hybrid coordinator's: a length counts
        when every group hits). So a prefix whose sliding blocks were evicted after
        leaving the window still hits; the sliding entries before that window are None
        (allocate_slots takes none of them).
        """
        if not self.enable_caching or seq.request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (as in vLLM)
        found: list[tuple[KVBlock | None, ...]] = []
        for block_hash in self.prompt_block_hashes(seq):
            blocks = tuple(self._lookup(block_hash, group) for group in range(self.num_groups))
            if any(block is None for block, window in zip(blocks, self.group_windows)
                   if window is None):
                break  # a full group's prefix ends here
            found.append(blocks)
        for length in range(len(found), 0, -1):
            if not self._has_snapshot(seq, length):
                continue
            first = self.first_kept_block(length * self.block_size)
            if all(block is not None for blocks in found[first:length] for block in blocks):
                before = [tuple(None if window else block
                                for block, window in zip(blocks, self.group_windows))
                          for blocks in found[:first]]
                return before + found[first:length]
        return []

    def explain_miss(self, seq: Sequence, num_hit: int) -> PrefixMiss | None:
        """Why the sequence's prefix hit (find_cached_prefix's) ended after `num_hit` blocks
        when the cache had seen what follows (engine.core.prefix_misses): the next blocks
        were evicted (counted while they run on, the first one's evictor named), or the
        tokens past the hit share a leading run with a cached block that follows the same
        prefix but parts from them mid-block. None when neither holds."""
        if not self.enable_caching or seq.request.params.prompt_logprobs is not None:
            return None
        hashes, bs = self.prompt_block_hashes(seq), self.block_size
        if num_hit < len(hashes):
            if self._lookup(hashes[num_hit], 0) is not None:
                return None  # cached, but cut off (a recurrent snapshot, a sliding window)
            first = self._eviction(hashes[num_hit])
            if first is not None:
                run = 1 + sum(1 for _ in takewhile(lambda h: self._eviction(h) is not None,
                                                   hashes[num_hit + 1:]))
                return PrefixMiss(seq, MissReason.EVICTED, run * bs, first.by, first.step)
            if num_hit == 0:
                salted_apart = self._cached_under_another_salt(seq, hashes)
                if salted_apart:
                    return PrefixMiss(seq, MissReason.SALT_MISMATCH, salted_apart)
            tokens = hashes[num_hit][2]
        elif seq.num_tokens % bs:
            # The prompt's last, partial block, less its last token (always computed).
            tokens = tuple(seq.token_ids[num_hit * bs:seq.num_tokens - 1])
        else:
            return None  # a full last block is computed for the last token's logits
        parent = hashes[num_hit - 1][0] if num_hit else None
        shared = common_length(tokens, self.pool.followers.get(parent) or ())
        # All of a full block shared: that very block was cached, evicted beyond memory.
        if 0 < shared < bs:
            return PrefixMiss(seq, MissReason.PARTIAL_BLOCK, shared)
        return None

    def _cached_under_another_salt(self, seq: Sequence, hashes: list[BlockHash]) -> int:
        """The prompt's leading tokens the cache holds under the cache_salt its first block
        was last cached with, when that salt is not the sequence's (0 otherwise)."""
        first_tokens = hashes[0][2]
        recorded = self.pool.first_block_salts.get(hash_block_tokens(None, first_tokens))
        if recorded is None or recorded[0] == seq.request.cache_salt:
            return 0
        parent, run = None, 0
        for index, (_, _, tokens) in enumerate(hashes):
            value = hash_block_tokens(parent, tokens, recorded[0] if index == 0 else None)
            if self.pool.lookup(value, tokens, parent) is None:
                break
            parent, run = value, run + 1
        return run * self.block_size

    def _eviction(self, block_hash: BlockHash) -> Eviction | None:
        """Who evicted this block's content, in any KV cache group, if remembered."""
        for group in range(self.num_groups):
            eviction = self.pool.evicted.get(group_block_hash(block_hash, group)[0])
            if eviction is not None:
                return eviction
        return None

    def prompt_block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """The hashes of the blocks find_cached_prefix may reuse (all but the last token's)."""
        return self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)

    def _has_snapshot(self, seq: Sequence, num_blocks: int) -> bool:
        """Whether a prefix of num_blocks blocks can be a hit for the recurrent state too:
        a snapshot of the state after it is kept (always, without recurrent layers)."""
        return (self.state_slots is None
                or seq.block_hashes[num_blocks - 1] in self.state_slots.snapshots)

    def snapshot_chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) should end so the state can be snapshot: at
        the last snapshot boundary inside it, if any (the chunk as it is otherwise)."""
        if self.state_slots is None or not self.enable_caching:
            return end
        boundary = end // self.snapshot_tokens * self.snapshot_tokens
        return boundary if start < boundary < end else end

    def _lookup(self, block_hash: BlockHash, group: int) -> KVBlock | None:
        value, parent, token_ids = group_block_hash(block_hash, group)
        return self.pool.lookup(value, token_ids, parent)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of the sequence's first `num_blocks` full blocks; each block is
        hashed once in the sequence's life (they are kept on it, as vLLM's request is)."""
        hashes, bs = seq.block_hashes, self.block_size
        for index in range(len(hashes), num_blocks):
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            parent = hashes[-1][0] if hashes else None
            salt = seq.request.cache_salt if index == 0 else None
            hashes.append((hash_block_tokens(parent, tokens, salt), parent, tokens))
        return hashes[:num_blocks]

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int,
        cached_prefix: list[tuple[KVBlock | None, ...]] = (),
    ) -> list[tuple[int, int]] | None:
        """Room for `num_new_tokens` more computed tokens, after adopting `cached_prefix`
        (find_cached_prefix's positions).

        Returns the copy-on-write block copies (src, dst) the device must do before the
        step writes, or None when the pool cannot supply the blocks (then nothing changed
        but the freeing of blocks that left the sliding window).
        """
        pool, table = self.pool, seq.block_table
        # Always valid, and it may free the very blocks this step needs.
        self.release_out_of_window(seq)
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        adopted = [block for blocks in cached_prefix for block in blocks if block is not None]
        num_new_blocks, shared_targets, wanted = self._allocation(seq, num_new_tokens,
                                                                  cached_prefix)
        if wanted > pool.num_free_blocks:
            return None
        slots = self.state_slots
        if slots is not None and seq.state_slot is None:
            if not slots.num_free:
                return None
            # At admission, with the sequence's first blocks.
            if cached_prefix:
                slots.restore(seq, seq.block_hashes[len(cached_prefix) - 1])
            else:
                slots.take(seq)

        if shared_targets or cached_prefix or num_new_blocks > 0:  # most decodes: none
            self.emit(BlockTableChanged(seq, shared_targets[0] if shared_targets
                                        else len(table)))
        if seq.num_computed_tokens == 0 and self.enable_caching:
            self.prefix_stats.queries += seq.num_tokens
            self.prefix_stats.hits += len(cached_prefix) * self.block_size
        if cached_prefix:
            pool.share(adopted, prefix_hit=True)
            table.extend(RELEASED if block is None else block.block_id
                         for blocks in cached_prefix for block in blocks)
            # The sliding groups' entries before the window were not adopted.
            seq.num_released_blocks = min(self.first_kept_block(num_computed),
                                          len(cached_prefix)) if self.sliding_groups else 0
            seq.num_cached_blocks = len(cached_prefix)
            seq.num_computed_tokens = num_computed
        copies = []
        # Built only when a block is taken (most decodes take none).
        evictor = (Eviction(seq.request.request_id, self.step)
                   if shared_targets or num_new_blocks > 0 else None)
        for index in shared_targets:
            source = pool.blocks[table[index]]
            (target,) = pool.allocate(1, evictor)
            pool.release([source])
            table[index] = target.block_id
            copies.append((source.block_id, target.block_id))
        if num_new_blocks > 0:
            table.extend(b.block_id for b in pool.allocate(num_new_blocks, evictor))
        return copies

    def free_blocks_wanted(self, seq: Sequence, num_new_tokens: int,
                           cached_prefix: list[tuple[KVBlock | None, ...]] = ()) -> int:
        """The free blocks allocate_slots(seq, num_new_tokens, cached_prefix) takes."""
        return self._allocation(seq, num_new_tokens, cached_prefix)[2]

    def _allocation(self, seq: Sequence, num_new_tokens: int,
                    cached_prefix: list[tuple[KVBlock | None, ...]]) -> tuple[int, list[int], int]:
        """What an allocation takes: the new pool blocks (negative: none), the table
        entries shared with others that the write lands in (copied on write), and the
        free blocks all that takes (new ones, copy targets, cached-free prefix blocks it
        revives)."""
        table, groups, blocks = seq.block_table, self.num_groups, self.pool.blocks
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        first_write = (num_computed // self.block_size) * groups
        shared_targets = [i for i in range(first_write, len(table))
                          if table[i] != RELEASED and blocks[table[i]].ref_count > 1]
        num_new_blocks = groups * (self.blocks_needed(num_computed + num_new_tokens)
                                   - len(table) // groups - len(cached_prefix))
        revived = sum([block is not None and block.ref_count == 0
                       for positions in cached_prefix for block in positions])
        return (num_new_blocks, shared_targets,
                max(num_new_blocks, 0) + len(shared_targets) + revived)

    def blocks_freed_by(self, seqs: Iterable[Sequence], kept: Iterable[KVBlock] = ()) -> int:
        """The pool blocks that freeing all of these sequences would return: the ones no
        other sequence holds, less `kept` (a taker's cached prefix, which it would take
        back at once)."""
        holders: dict[int, int] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id != RELEASED:
                    holders[block_id] = holders.get(block_id, 0) + 1
        for block in kept:
            holders.pop(block.block_id, None)
        blocks = self.pool.blocks
        return sum(1 for block_id, count in holders.items()
                   if blocks[block_id].ref_count == count)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's newly full, computed blocks so later prompts can reuse them."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_caching or num_full <= seq.num_cached_blocks:
            return  # most decode steps fill no block
        hashes = self._block_hashes(seq, num_full)
        groups, table = self.num_groups, seq.block_table
        # Group by group, so each group's new blocks are stored in prefix order one after
        # another (the KV-event publisher sends such a run as one BlockStored).
        for group in range(groups):
            for position in range(seq.num_cached_blocks, num_full):
                # Released blocks were hashed before they left the window (or, after a
                # swap-in, need no hash: their K/V is gone).
                block_id = table[position * groups + group]
                if block_id != RELEASED:
                    self.pool.cache(self.pool.blocks[block_id],
                                    group_block_hash(hashes[position], group), group)
        if seq.num_cached_blocks == 0:  # its first block: whose salt its tokens are under
            self.pool.first_block_salts.put(hash_block_tokens(None, hashes[0][2]),
                                            (seq.request.cache_salt,))
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)
        if (self.state_slots is not None and seq.state_slot is not None
                and seq.num_computed_tokens % self.snapshot_tokens == 0):
            self.state_slots.snapshot(seq, hashes[num_full - 1])

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold the sequence's first `num_tokens` tokens and free the
        ones past them, last first: speculative decoding's rollback, after verification
        rejected the proposals written there. Those blocks were never cached (only full
        blocks of computed tokens are, and rejected tokens never count as computed)."""
        keep = self.pool_blocks_needed(num_tokens)
        if keep >= len(seq.block_table):
            return
        self.pool.release(reversed(self.held_blocks(seq.block_table[keep:])))
        del seq.block_table[keep:]
        self.emit(BlockTableChanged(seq, keep))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)
        and gets a state slot holding a copy of the parent's state; with no slot free it
        holds nothing and computes its tokens afresh."""
        if self.state_slots is not None and not self.state_slots.fork(parent, child):
            return
        self.pool.share(self.held_blocks(parent.block_table))
        child.block_table = list(parent.block_table)
        child.num_released_blocks = parent.num_released_blocks
        self.emit(BlockTableChanged(child, 0))
        # A preempted parent (a beam swapped out) has no device blocks to share: the child
        # computes its tokens afresh.
        child.num_computed_tokens = parent.num_computed_tokens if parent.block_table else 0
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, last first (so its tail is evicted before its prefix)."""
        self.pool.release(reversed(self.held_blocks(seq.block_table)))
        if self.state_slots is not None:
            self.state_slots.release(seq)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_cached_blocks = 0
        self.emit(BlockTableChanged(seq, 0))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move the sequence's blocks to the CPU pool: (device, cpu) copies, or None if the
        CPU pool is too small (the caller recomputes instead). The swap table keeps the
        block table's layout, RELEASED entries included."""
        table = seq.block_table
        held = [block_id for block_id in table if block_id != RELEASED]
        if len(held) > len(self.free_swap_blocks):
            return None
        swap_blocks = iter([self.free_swap_blocks.pop() for _ in held])
        swap_table = [RELEASED if block_id == RELEASED else next(swap_blocks)
                      for block_id in table]
        self.free(seq)
        seq.swap_table = swap_table
        self.swap_stats.swap_outs += 1
        self.swap_stats.blocks_out += len(held)
        return [(device, cpu) for device, cpu in zip(table, swap_table) if device != RELEASED]

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back into fresh device blocks, with room for
        `num_new_tokens` more: (cpu, device) copies, or None if the pool is short."""
        swapped = seq.swap_table
        held = [cpu for cpu in swapped if cpu != RELEASED]
        count = self.swap_in_blocks_wanted(seq, num_new_tokens)
        if count > self.pool.num_free_blocks:
            return None
        blocks = iter(block.block_id for block in self.pool.allocate(
            count, Eviction(seq.request.request_id, self.step)))
        seq.block_table = [RELEASED if cpu == RELEASED else next(blocks) for cpu in swapped]
        seq.block_table.extend(blocks)
        seq.num_released_blocks = (self.group_table(seq, self.sliding_groups[0]).count(RELEASED)
                                   if self.sliding_groups else 0)
        self.emit(BlockTableChanged(seq, 0))
        copies = [(cpu, device) for cpu, device in zip(swapped, seq.block_table)
                  if cpu != RELEASED]
        self.free_swap_blocks.extend(held)
        seq.swap_table = []
        self.swap_stats.swap_ins += 1
        self.swap_stats.blocks_in += len(held)
        return copies

    def swap_in_blocks_wanted(self, seq: Sequence, num_new_tokens: int) -> int:
        """The free blocks swap_in(seq, num_new_tokens) takes."""
        swapped, groups = seq.swap_table, self.num_groups
        new_positions = max(self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
                            - len(swapped) // groups, 0)
        return sum(1 for cpu in swapped if cpu != RELEASED) + new_positions * groups

    def drop_swapped(self, seq: Sequence) -> None:
        """Forget a swapped sequence's CPU copy (it finished or was aborted while out)."""
        self.free_swap_blocks.extend(i for i in seq.swap_table if i != RELEASED)
        seq.swap_table = []

    def stat_totals(self) -> tuple[int, int, int, int]:
        """(prefix queries, prefix hits, blocks swapped out, blocks swapped in) so far."""
        return (self.prefix_stats.queries, self.prefix_stats.hits,
                self.swap_stats.blocks_out, self.swap_stats.blocks_in)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
