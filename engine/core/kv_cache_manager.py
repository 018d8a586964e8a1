"""Per-sequence block allocation, prefix-cache lookup, copy-on-write, sharing stats, and
the freeing of blocks that leave a sliding window."""

from dataclasses import dataclass

from kvscope.engine.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from kvscope.engine.core.kv_events import BlockTableChanged, KVEventSink, discard
from kvscope.engine.core.request import Sequence


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

    sliding_window=W (every layer attends to the last W positions only): a block wholly
    before the window of a sequence's next token is freed while the sequence runs, and
    its table entry becomes RELEASED, so a sequence holds at most ceil(W / block_size) + 1
    blocks while it decodes (docs/architecture.md, "Sliding windows").
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, emit: KVEventSink = discard,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.emit = emit
        self.pool = BlockPool(num_blocks, enable_caching, emit)
        self.prefix_stats = PrefixCacheStats()
        # The CPU swap pool: block ids not holding a swapped-out sequence's K/V.
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks = list(range(num_swap_blocks))
        self.swap_stats = SwapStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_kept_block(self, num_computed: int) -> int:
        """The first block a sequence with `num_computed` tokens still needs: the token at
        position num_computed sees keys (num_computed - W, num_computed]."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def held_blocks(self, table: list[int]) -> list[KVBlock]:
        """The blocks a table holds (its RELEASED entries hold none)."""
        return [self.pool.blocks[i] for i in table if i != RELEASED]

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free the blocks wholly before the window of the sequence's next token.

        They were hashed when they filled (cache_full_blocks), so with prefix caching they
        join the cached-free queue's tail in position order, behind the blocks freed
        before them: a later prompt with the same prefix still finds them until they are
        evicted, oldest first.
        """
        start = seq.num_released_blocks
        end = min(self.first_kept_block(seq.num_computed_tokens), len(seq.block_table))
        if end <= start:
            return
        released = seq.block_table[start:end]
        seq.block_table[start:end] = [RELEASED] * (end - start)
        seq.num_released_blocks = end
        self.emit(BlockTableChanged(seq, start))
        self.pool.release(self.pool.blocks[i] for i in released)

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock | None]:
        """The longest prefix of the sequence's tokens whose K/V the cache holds, as blocks.

        At most (num_tokens - 1) tokens are reused, so one token is always computed
        and produces the logits to sample from. Under full attention every block of the
        prefix must be cached. With a sliding window only the blocks the next token's
        window sees must be (vLLM's SlidingWindowManager rule), so a prefix whose oldest
        blocks were evicted after leaving the window still hits; the entries of blocks
        before that window are None (allocate_slots takes none of them).
        """
        if not self.enable_caching or seq.request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (as in vLLM)
        found: list[KVBlock | None] = []
        for value, parent, token_ids in self._block_hashes(
                seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(value, token_ids, parent)
            if block is None and self.sliding_window is None:
                break
            found.append(block)
        for length in range(len(found), 0, -1):
            first = self.first_kept_block(length * self.block_size)
            if all(block is not None for block in found[first:length]):
                return [None] * first + found[first:length]
        return []

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of the sequence's first `num_blocks` full blocks; each block is
        hashed once in the sequence's life (they are kept on it, as vLLM's request is)."""
        hashes, bs = seq.block_hashes, self.block_size
        for index in range(len(hashes), num_blocks):
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            parent = hashes[-1][0] if hashes else None
            hashes.append((hash_block_tokens(parent, tokens), parent, tokens))
        return hashes[:num_blocks]

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_prefix: list[KVBlock | None] = ()
    ) -> list[tuple[int, int]] | None:
        """Room for `num_new_tokens` more computed tokens, after adopting `cached_prefix`.

        Returns the copy-on-write block copies (src, dst) the device must do before the
        step writes, or None when the pool cannot supply the blocks (then nothing changed
        but the freeing of blocks that left the sliding window).
        """
        pool = self.pool
        # Always valid, and it may free the very blocks this step needs.
        self.release_out_of_window(seq)
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        # Only the prefix blocks in the window are taken (find_cached_prefix found those).
        skipped = min(self.first_kept_block(num_computed), len(cached_prefix))
        adopted = cached_prefix[skipped:]
        first_write_block = num_computed // self.block_size
        shared_targets = [
            i for i in range(first_write_block, len(seq.block_table))
            if pool.blocks[seq.block_table[i]].ref_count > 1
        ]
        num_new_blocks = (self.blocks_needed(num_computed + num_new_tokens)
                          - len(seq.block_table) - len(cached_prefix))
        revived = sum(1 for block in adopted if block.ref_count == 0)
        if max(num_new_blocks, 0) + len(shared_targets) + revived > pool.num_free_blocks:
            return None

        if shared_targets or cached_prefix or num_new_blocks > 0:  # most decodes: none
            self.emit(BlockTableChanged(seq, shared_targets[0] if shared_targets
                                        else len(seq.block_table)))
        if seq.num_computed_tokens == 0 and self.enable_caching:
            self.prefix_stats.queries += seq.num_tokens
            self.prefix_stats.hits += len(cached_prefix) * self.block_size
        if cached_prefix:
            pool.share(adopted, prefix_hit=True)
            seq.block_table.extend([RELEASED] * skipped)
            seq.block_table.extend(block.block_id for block in adopted)
            seq.num_released_blocks = skipped
            seq.num_cached_blocks = len(cached_prefix)
            seq.num_computed_tokens = num_computed
        copies = []
        for index in shared_targets:
            source = pool.blocks[seq.block_table[index]]
            (target,) = pool.allocate(1)
            pool.release([source])
            seq.block_table[index] = target.block_id
            copies.append((source.block_id, target.block_id))
        if num_new_blocks > 0:
            seq.block_table.extend(b.block_id for b in pool.allocate(num_new_blocks))
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's newly full, computed blocks so later prompts can reuse them."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq, num_full)
        # Released blocks were hashed before they left the window (or, after a swap-in,
        # need no hash: their K/V is gone).
        for index in range(max(seq.num_cached_blocks, seq.num_released_blocks), num_full):
            self.pool.cache(self.pool.blocks[seq.block_table[index]], hashes[index])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold the sequence's first `num_tokens` tokens and free the
        ones past them, last first: speculative decoding's rollback, after verification
        rejected the proposals written there. Those blocks were never cached (only full
        blocks of computed tokens are, and rejected tokens never count as computed)."""
        keep = self.blocks_needed(num_tokens)
        if keep >= len(seq.block_table):
            return
        self.pool.release(reversed(self.held_blocks(seq.block_table[keep:])))
        del seq.block_table[keep:]
        self.emit(BlockTableChanged(seq, keep))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)."""
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
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_cached_blocks = 0
        self.emit(BlockTableChanged(seq, 0))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move the sequence's blocks to the CPU pool: (device, cpu) copies, or None if the
        CPU pool is too small (the caller recomputes instead)."""
        released = seq.num_released_blocks
        held = seq.block_table[released:]
        if len(held) > len(self.free_swap_blocks):
            return None
        swap_blocks = [self.free_swap_blocks.pop() for _ in held]
        copies = list(zip(held, swap_blocks))
        count = len(held)
        self.free(seq)
        seq.swap_table = [RELEASED] * released + swap_blocks
        self.swap_stats.swap_outs += 1
        self.swap_stats.blocks_out += count
        return copies

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back into fresh device blocks, with room for
        `num_new_tokens` more: (cpu, device) copies, or None if the pool is short."""
        released = seq.swap_table.count(RELEASED)  # the table's first entries
        count = len(seq.swap_table) - released
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        if max(total, len(seq.swap_table)) - released > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(max(total, len(seq.swap_table)) - released)
        seq.block_table = [RELEASED] * released + [block.block_id for block in blocks]
        seq.num_released_blocks = released
        self.emit(BlockTableChanged(seq, 0))
        swapped = seq.swap_table[released:]
        copies = list(zip(swapped, seq.block_table[released:released + count]))
        self.free_swap_blocks.extend(swapped)
        seq.swap_table = []
        self.swap_stats.swap_ins += 1
        self.swap_stats.blocks_in += count
        return copies

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
