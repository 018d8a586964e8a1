"""Per-sequence block allocation, prefix-cache lookup, copy-on-write and sharing stats."""

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


class KVCacheManager:
    """Gives each sequence the blocks it needs, sharing cached and forked blocks; reports
    each block table change (and, through its pool, each block change) to `emit`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, emit: KVEventSink = discard) -> None:
        self.block_size = block_size
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

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached blocks matching the sequence's tokens.

        At most (num_tokens - 1) tokens are reused, so one token is always computed
        and produces the logits to sample from.
        """
        if not self.enable_caching or seq.request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (as in vLLM)
        hits: list[KVBlock] = []
        for value, parent, token_ids in self._block_hashes(
                seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(value, token_ids, parent)
            if block is None:
                break
            hits.append(block)
        return hits

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
        self, seq: Sequence, num_new_tokens: int, cached_prefix: list[KVBlock] = ()
    ) -> list[tuple[int, int]] | None:
        """Room for `num_new_tokens` more computed tokens, after adopting `cached_prefix`.

        Returns the copy-on-write block copies (src, dst) the device must do before the
        step writes, or None (changing nothing) when the pool cannot supply the blocks.
        """
        pool = self.pool
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        first_write_block = num_computed // self.block_size
        shared_targets = [
            i for i in range(first_write_block, len(seq.block_table))
            if pool.blocks[seq.block_table[i]].ref_count > 1
        ]
        num_new_blocks = (self.blocks_needed(num_computed + num_new_tokens)
                          - len(seq.block_table) - len(cached_prefix))
        revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if max(num_new_blocks, 0) + len(shared_targets) + revived > pool.num_free_blocks:
            return None

        if shared_targets or cached_prefix or num_new_blocks > 0:  # most decodes: none
            self.emit(BlockTableChanged(seq, shared_targets[0] if shared_targets
                                        else len(seq.block_table)))
        if seq.num_computed_tokens == 0 and self.enable_caching:
            self.prefix_stats.queries += seq.num_tokens
            self.prefix_stats.hits += len(cached_prefix) * self.block_size
        if cached_prefix:
            pool.share(cached_prefix)
            seq.block_table.extend(block.block_id for block in cached_prefix)
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
        for index in range(seq.num_cached_blocks, num_full):
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
        self.pool.release(self.pool.blocks[i] for i in reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]
        self.emit(BlockTableChanged(seq, keep))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)."""
        self.pool.share(self.pool.blocks[i] for i in parent.block_table)
        child.block_table = list(parent.block_table)
        self.emit(BlockTableChanged(child, 0))
        # A preempted parent (a beam swapped out) has no device blocks to share: the child
        # computes its tokens afresh.
        child.num_computed_tokens = parent.num_computed_tokens if parent.block_table else 0
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks, last first (so its tail is evicted before its prefix)."""
        self.pool.release(self.pool.blocks[i] for i in reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        self.emit(BlockTableChanged(seq, 0))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move the sequence's blocks to the CPU pool: (device, cpu) copies, or None if the
        CPU pool is too small (the caller recomputes instead)."""
        count = len(seq.block_table)
        if count > len(self.free_swap_blocks):
            return None
        swap_blocks = [self.free_swap_blocks.pop() for _ in range(count)]
        copies = list(zip(seq.block_table, swap_blocks))
        self.free(seq)
        seq.swap_table = swap_blocks
        self.swap_stats.swap_outs += 1
        self.swap_stats.blocks_out += count
        return copies

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back into fresh device blocks, with room for
        `num_new_tokens` more: (cpu, device) copies, or None if the pool is short."""
        count = len(seq.swap_table)
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        if max(total, count) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(max(total, count))
        seq.block_table = [block.block_id for block in blocks]
        self.emit(BlockTableChanged(seq, 0))
        copies = list(zip(seq.swap_table, seq.block_table[:count]))
        self.free_swap_blocks.extend(seq.swap_table)
        seq.swap_table = []
        self.swap_stats.swap_ins += 1
        self.swap_stats.blocks_in += count
        return copies

    def drop_swapped(self, seq: Sequence) -> None:
        """Forget a swapped sequence's CPU copy (it finished or was aborted while out)."""
        self.free_swap_blocks.extend(seq.swap_table)
        seq.swap_table = []

    def stat_totals(self) -> tuple[int, int, int, int]:
        """(prefix queries, prefix hits, blocks swapped out, blocks swapped in) so far."""
        return (self.prefix_stats.queries, self.prefix_stats.hits,
                self.swap_stats.blocks_out, self.swap_stats.blocks_in)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
