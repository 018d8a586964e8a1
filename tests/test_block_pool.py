"""Block pool and KV cache manager: invariants under random workloads, LRU order, prefix hits."""


import gc

import pytest
from conftest import make_sequence
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

import kvscope.engine.core.kv_cache_manager as kv_cache_manager_module
from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import RELEASED, KVCacheManager
from kvscope.engine.core.kv_events import (
    BlockRemoved,
    BlocksAllocated,
    BlocksReleased,
    BlocksShared,
    BlockStored,
    KVEvent,
)
from kvscope.engine.core.request import Sequence


def admit(manager: KVCacheManager, seq: Sequence) -> bool:
    """What the scheduler does for a new prompt: adopt its cached prefix, allocate the rest,
    then (as the step does) mark every token computed and cache the full blocks."""
    cached_prefix = manager.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached_prefix) * manager.block_size
    if manager.allocate_slots(seq, num_new, cached_prefix) is None:
        return False
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    return True


def check_pool_invariants(pool: BlockPool, live: list[Sequence]) -> None:
    blocks = pool.blocks
    used = [b for b in blocks if b.ref_count >= 1]
    cached_free = [b for b in blocks if b.ref_count == 0 and b.block_hash is not None]
    plain_free = [b for b in blocks if b.ref_count == 0 and b.block_hash is None]
    assert all(b.ref_count >= 0 for b in blocks)
    assert len(plain_free) + len(cached_free) + len(used) == pool.num_blocks
    assert pool.num_used_blocks == len(used)
    assert pool.num_cached_free_blocks == len(cached_free)
    assert pool.num_free_blocks == len(plain_free) + len(cached_free)

    # The free queue: a consistent doubly linked list holding exactly the ref-0 blocks.
    queue = list(pool.free_queue)
    assert len(queue) == pool.free_queue.num_free_blocks == pool.num_free_blocks
    assert len({b.block_id for b in queue}) == len(queue)
    assert {b.block_id for b in queue} == {b.block_id for b in plain_free + cached_free}
    node = pool.free_queue.head
    while node.next_free is not None:
        assert node.next_free.prev_free is node
        node = node.next_free
    assert node is pool.free_queue.tail
    assert all(b.prev_free is None and b.next_free is None for b in used)

    # Ref counts are exactly the number of block tables that hold each block.
    holders = [0] * pool.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            if block_id != RELEASED:
                holders[block_id] += 1
    assert [b.ref_count for b in blocks] == holders

    # The hash map points at blocks that carry that very hash.
    for key, block_id in pool.cached_blocks.items():
        block = pool.blocks[block_id]
        assert block.block_hash is not None and block.block_hash[0] == key


def visible_positions(position: int, window: int | None) -> range:
    """The key positions a token at `position` sees: (position - window, position], all of
    [0, position] without a window (transformers' mask)."""
    return range(max(0, position - window + 1) if window else 0, position + 1)


def check_windows_held(manager: KVCacheManager, live: list[Sequence],
                       slots: list[list[int | None]] | None = None) -> None:
    """From below: every computed key the sequence's next token sees is in a block its table
    holds, in every KV cache group (worked out from the positions, the window and the block
    size, not the manager's own arithmetic); with `slots` (what each block's slots were
    written with), that block's slot holds the sequence's own token there."""
    size, groups = manager.block_size, manager.num_groups
    for number, seq in enumerate(live):
        next_position = seq.num_computed_tokens
        for group, window in enumerate(manager.group_windows):
            for key in visible_positions(next_position, window)[:-1]:
                block = seq.block_table[key // size * groups + group]
                assert block != RELEASED and manager.pool.blocks[block].ref_count > 0, (
                    f"live sequence {number} (next position {next_position}, window {window}): "
                    f"group {group} released the block of key {key}, which it still sees")
                if slots is not None:
                    assert slots[block][key % size] == seq.token_ids[key], (
                        f"live sequence {number}: key {key} reads another token from block "
                        f"{block}")


class EventReplay:
    """Each block's ref count and hash rebuilt from the pool's events alone, checking on
    the way that every event fits the state before it (allocated blocks were free, only
    unhashed blocks get stored, a removed hash is the one the block held)."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_counts = [0] * num_blocks
        self.hashes: list = [None] * num_blocks

    def apply(self, event: KVEvent) -> None:
        match event:
            case BlocksAllocated(block_ids):
                for block_id in block_ids:
                    assert self.ref_counts[block_id] == 0 and self.hashes[block_id] is None
                    self.ref_counts[block_id] = 1
            case BlocksShared(block_ids):
                for block_id in block_ids:
                    self.ref_counts[block_id] += 1
            case BlocksReleased(block_ids):
                for block_id in block_ids:
                    assert self.ref_counts[block_id] > 0
                    self.ref_counts[block_id] -= 1
            case BlockStored(block_id, block_hash):
                assert self.hashes[block_id] is None
                self.hashes[block_id] = block_hash
            case BlockRemoved(block_id, block_hash):
                assert self.hashes[block_id] == block_hash
                self.hashes[block_id] = None

    def check(self, pool: BlockPool) -> None:
        assert self.ref_counts == [block.ref_count for block in pool.blocks]
        assert self.hashes == [block.block_hash for block in pool.blocks]


# Speculative decoding's proposals that verification rejects: a token the machine never
# accepts, so a slot holding it is a rejected proposal's.
REJECTED = 9


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free, and proposals verified with some rejected
    (speculative decoding's rollback), on a small pool with a small vocabulary, so prefix
    hits, evictions, copy-on-write and running out of blocks all happen. `slots` models
    what the device's K/V slots hold, written as the engine writes them."""

    sequences = Bundle("sequences")
    group_windows: tuple[int | None, ...] = (None,)  # the KV cache groups' windows
    num_blocks = 12
    num_state_slots = 0  # recurrent layers' state slots (StateSlotMachine)

    def __init__(self) -> None:
        super().__init__()
        self.replay = EventReplay(self.num_blocks)
        self.manager = KVCacheManager(num_blocks=self.num_blocks, block_size=4,
                                      enable_caching=True, emit=self.replay.apply,
                                      group_windows=self.group_windows,
                                      num_state_slots=self.num_state_slots,
                                      snapshot_every_n_blocks=1)
        self.live: list[Sequence] = []
        self.decoding: set[int] = set()  # ids of sequences whose last step was a decode
        self.slots = [[None] * 4 for _ in range(self.num_blocks)]

    def write(self, seq: Sequence, start: int, tokens: list[int],
              copies: list[tuple[int, int]] = ()) -> None:
        """A step's device work: copy-on-write copies, then K/V for tokens from `start`
        (each into a block this sequence alone holds, in every KV cache group)."""
        for source, target in copies:
            self.slots[target] = list(self.slots[source])
        self.write_state(seq, start, tokens)
        groups = self.manager.num_groups
        for position, token in enumerate(tokens, start):
            for group in range(groups):
                block = seq.block_table[position // 4 * groups + group]
                assert self.manager.pool.blocks[block].ref_count == 1
                self.slots[block][position % 4] = token

    def write_state(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """The recurrent layers' part of a step (StateSlotMachine): the tokens folded into
        the sequence's state slot, which must hold its tokens before `start` exactly."""

    @rule(target=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def allocate(self, tokens):
        seq = make_sequence(tokens)
        before = [(b.ref_count, b.block_hash) for b in self.manager.pool.blocks]
        # admit's steps, with the device's write where the step makes it: after the
        # allocation (and the copies it owes), before the tokens count as computed.
        cached_prefix = self.manager.find_cached_prefix(seq)
        num_cached = len(cached_prefix) * 4
        if self.manager.allocate_slots(seq, len(tokens) - num_cached, cached_prefix) is None:
            # A refused allocation changes nothing.
            assert seq.block_table == [] and seq.state_slot is None
            assert [(b.ref_count, b.block_hash) for b in self.manager.pool.blocks] == before
            return seq  # stays in the bundle; later rules skip it (empty block table)
        self.decoding.discard(id(seq))
        # In two chunks where the first may end on a state snapshot's boundary (as the
        # scheduler cuts a recurrent model's prefill; one chunk otherwise).
        first_end = self.manager.snapshot_chunk_end(num_cached, len(tokens))
        for start, end in ((num_cached, first_end), (first_end, len(tokens))):
            if end > start:
                self.write(seq, start, tokens[start:end])
                seq.num_computed_tokens = end
                self.manager.cache_full_blocks(seq)
        self.live.append(seq)
        return seq

    @rule(seq=sequences, token=st.integers(0, 2))
    def append(self, seq, token):
        if seq not in self.live:
            return
        seq.token_ids.append(token)
        copies = self.manager.allocate_slots(seq, 1)
        if copies is None:
            seq.token_ids.pop()
            return
        # Copy-on-write happened where needed: the block this token is written to is ours alone.
        self.write(seq, seq.num_computed_tokens, [token], copies)
        seq.num_computed_tokens += 1
        self.manager.cache_full_blocks(seq)
        self.decoding.add(id(seq))

    @rule(seq=sequences, accepted=st.lists(st.integers(0, 2), max_size=5),
          num_rejected=st.integers(0, 5))
    def propose_and_verify(self, seq, accepted, num_rejected):
        """Write K/V for proposed tokens, accept a prefix of them and roll back the rest,
        as EngineCore does after a verifying step."""
        proposal = accepted + [REJECTED] * num_rejected
        # A recurrent state cannot roll back: the engine refuses speculative decoding there.
        if seq not in self.live or not proposal or self.num_state_slots:
            return
        copies = self.manager.allocate_slots(seq, len(proposal))
        if copies is None:
            return
        self.write(seq, seq.num_computed_tokens, proposal, copies)
        seq.token_ids.extend(accepted)
        seq.num_computed_tokens += len(accepted)
        self.manager.truncate(seq, seq.num_computed_tokens)
        self.manager.cache_full_blocks(seq)
        # A verification chunk holds the window of its first proposal: the decode bound
        # on held blocks applies again after the next plain decode.
        self.decoding.discard(id(seq))
        # No block holds only rejected tokens.
        assert len(seq.block_table) == self.manager.pool_blocks_needed(seq.num_computed_tokens)

    @rule(target=sequences, parent=sequences)
    def fork(self, parent):
        if parent not in self.live:
            return make_sequence([0])  # a never-admitted placeholder
        child = make_sequence(parent.token_ids)
        self.manager.fork(parent, child)
        if child.block_table:  # else no state slot was free: the child recomputes
            self.live.append(child)
            self.fork_copies()
        return child

    def fork_copies(self) -> None:
        """The state copies the engine does before the next forward (StateSlotMachine)."""

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.live:
            self.manager.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule()
    def free_everything(self):
        for seq in self.live:
            self.manager.free(seq)
        self.live.clear()
        pool = self.manager.pool
        assert pool.num_used_blocks == 0
        assert pool.num_free_blocks == pool.num_blocks

    @invariant()
    def pool_is_consistent(self):
        check_pool_invariants(self.manager.pool, self.live)

    @invariant()
    def sequences_hold_every_key_their_next_token_sees(self):
        check_windows_held(self.manager, self.live, self.slots)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        """So no cached hash ever covers a rejected proposal's slot."""
        for block in self.manager.pool.blocks:
            if block.block_hash is not None:
                assert self.slots[block.block_id] == list(block.block_hash[2])

    @invariant()
    def events_describe_the_pool(self):
        self.replay.check(self.manager.pool)

    def teardown(self):
        for seq in self.live:
            self.manager.free(seq)
        assert self.manager.pool.num_used_blocks == 0
        check_pool_invariants(self.manager.pool, [])


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_pool_invariants = BlockPoolMachine.TestCase


class WindowedBlockPoolMachine(BlockPoolMachine):
    """The same workload with a sliding window of 6 tokens over blocks of 4: blocks leave
    the window (and return to the pool) while sequences decode, forks share tables that
    hold released entries, prefix hits adopt only the window's blocks."""

    group_windows = (6,)

    @invariant()
    def sequences_hold_only_their_window(self):
        manager = self.manager
        for seq in self.live:
            released = seq.num_released_blocks
            for group, window in enumerate(self.group_windows):
                table = manager.group_table(seq, group)
                if window is None:  # a full group keeps every block
                    assert RELEASED not in table
                    continue
                assert all(b == RELEASED for b in table[:released])
                assert all(b != RELEASED for b in table[released:])
                if id(seq) in self.decoding:
                    assert len(table) - released <= -(-window // 4) + 1


WindowedBlockPoolMachine.TestCase.settings = BlockPoolMachine.TestCase.settings
test_windowed_block_pool_invariants = WindowedBlockPoolMachine.TestCase


class HybridBlockPoolMachine(WindowedBlockPoolMachine):
    """A full group beside two sliding groups in one pool (Gemma's layout): the sliding
    groups free their blocks while the full group keeps all, in tables interleaved by
    position; prefix hits need the full group's whole prefix and the window's blocks."""

    group_windows = (None, 6, 6)
    num_blocks = 24


HybridBlockPoolMachine.TestCase.settings = BlockPoolMachine.TestCase.settings
test_hybrid_block_pool_invariants = HybridBlockPoolMachine.TestCase


# ---- LRU order and prefix hits ----------------------------------------------------------
BLOCK = 4


def full_blocks(*first_tokens: int) -> list[int]:
    """One full block per argument, each block filled with that token."""
    return [token for first in first_tokens for token in [first] * BLOCK]


def test_plain_free_blocks_are_taken_before_cached_ones():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_sequence(full_blocks(1, 2))
    assert admit(manager, a)
    a_blocks = list(a.block_table)
    manager.free(a)
    assert manager.pool.num_cached_free_blocks == 2

    b = make_sequence(full_blocks(3, 4))
    assert admit(manager, b)
    assert not set(b.block_table) & set(a_blocks)
    assert manager.pool.num_cached_free_blocks == 2
    assert manager.pool.num_evictions == 0


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a, b = make_sequence(full_blocks(1, 2)), make_sequence(full_blocks(3, 4))
    assert admit(manager, a) and admit(manager, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)

    c = make_sequence(full_blocks(5))
    assert admit(manager, c)
    # a was freed first, and within a its last block goes before its first.
    assert c.block_table == [a_blocks[1]]
    # (one block per position: a single KV cache group)
    assert [b.block_id for (b,) in manager.find_cached_prefix(make_sequence(
        full_blocks(1, 2) + [0]))] == [a_blocks[0]]
    d = make_sequence(full_blocks(6))
    assert admit(manager, d)
    assert d.block_table == [a_blocks[0]]
    # b's blocks survived both evictions.
    assert [blk.block_id for (blk,) in manager.find_cached_prefix(make_sequence(
        full_blocks(3, 4) + [0]))] == b_blocks


def test_prefix_hit_revives_a_cached_free_block():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_sequence(full_blocks(1, 2) + [7])
    assert admit(manager, a)
    a_blocks = list(a.block_table)
    manager.free(a)
    assert manager.pool.num_cached_free_blocks == 2

    again = make_sequence(full_blocks(1, 2) + [8, 9])
    hits = manager.find_cached_prefix(again)
    assert [block.block_id for (block,) in hits] == a_blocks[:2]
    assert manager.allocate_slots(again, 2, hits) is not None
    assert again.block_table[:2] == a_blocks[:2]
    assert again.num_computed_tokens == 2 * BLOCK
    assert [manager.pool.blocks[i].ref_count for i in a_blocks[:2]] == [1, 1]
    assert manager.pool.num_cached_free_blocks == 0
    assert manager.prefix_stats.hits == 2 * BLOCK
    check_pool_invariants(manager.pool, [again])


def test_prefix_reuse_stops_one_token_short_of_the_prompt():
    """A prompt that is entirely cached still computes its last token (for its logits)."""
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    assert admit(manager, make_sequence(full_blocks(1, 2)))
    assert len(manager.find_cached_prefix(make_sequence(full_blocks(1, 2)))) == 1


def test_shared_prefix_blocks_are_reference_counted_until_both_free():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    a = make_sequence(full_blocks(1, 2) + [3])
    b = make_sequence(full_blocks(1, 2) + [4])
    assert admit(manager, a) and admit(manager, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert [manager.pool.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    manager.free(a)
    check_pool_invariants(manager.pool, [b])
    manager.free(b)
    check_pool_invariants(manager.pool, [])
    assert manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("collision", ["constant", "ignores_parent"])
def test_hash_collision_gives_no_false_hit(monkeypatch, collision):
    """Blocks are matched by content, not by hash alone: a colliding hash finds nothing."""
    if collision == "constant":
        def fake_hash(parent, token_ids, cache_salt=None):
            return b"\x00" * 16
    else:
        def fake_hash(parent, token_ids, cache_salt=None):
            return repr(token_ids).encode()
    monkeypatch.setattr(kv_cache_manager_module, "hash_block_tokens", fake_hash)
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    assert admit(manager, make_sequence(full_blocks(1, 2, 3)))

    # Same hash as a cached block but different tokens, or the same tokens at another
    # position (another parent): neither may reuse the cached KV.
    assert manager.find_cached_prefix(make_sequence(full_blocks(5, 6) + [0])) == []
    assert manager.find_cached_prefix(make_sequence(full_blocks(2, 3) + [0])) == []
    # A true match is still found.
    assert len(manager.find_cached_prefix(make_sequence(full_blocks(1) + [0]))) == 1


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=False)
    a = make_sequence(full_blocks(1, 2))
    assert admit(manager, a)
    manager.free(a)
    assert manager.pool.num_cached_free_blocks == 0
    assert manager.find_cached_prefix(make_sequence(full_blocks(1, 2) + [0])) == []


def test_allocation_beyond_the_pool_is_refused_without_side_effects():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK)
    seq = make_sequence(full_blocks(1, 2, 3))
    assert manager.allocate_slots(seq, seq.num_tokens) is None
    assert seq.block_table == []
    assert manager.pool.num_free_blocks == 2


def test_fork_then_append_copies_the_shared_partial_block():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    parent = make_sequence(full_blocks(1) + [2, 3])
    assert admit(manager, parent)
    child = make_sequence(parent.token_ids)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table

    child.token_ids.append(9)
    copies = manager.allocate_slots(child, 1)
    # The full first block stays shared; the partial one is copied before the write.
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert manager.pool.blocks[parent.block_table[0]].ref_count == 2
    check_pool_invariants(manager.pool, [parent, child])


def test_cached_blocks_give_the_garbage_collector_nothing_to_walk():
    """A full collection walks every object the collector tracks: the prefix cache's state
    (hash tuples, the hash -> block id map) is made of untracked tuples, bytes and ints,
    so a million cached blocks cost a collection nothing (see kvscope.engine.core.block_pool)."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    seq = make_sequence(full_blocks(1, 2, 3))
    assert admit(manager, seq)
    manager.free(seq)
    # A collection untracks a tuple whose items are untracked already: a token tuple in
    # an older generation is untracked later in the same pass, its hash tuple the next.
    gc.collect()
    gc.collect()
    pool = manager.pool
    assert len(pool.cached_blocks) == 3
    assert not gc.is_tracked(pool.cached_blocks)
    assert not any(gc.is_tracked(block.block_hash) for block in pool.blocks)


class StateSlotMachine(BlockPoolMachine):
    """The same workload for a model with recurrent layers: 4 state slots beside a full
    group's blocks, the state snapshot at every block boundary (engine.core.state_slots).
    `states` models what each slot's state has consumed, written as the engine writes it:
    the copies owed (forks, snapshots, restores) first, all at once, then the tokens."""

    num_state_slots = 4

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[int, list[int]] = {}

    def fork_copies(self):
        copies = self.manager.state_slots.take_copies()
        targets = [target for _, target in copies]
        assert len(set(targets)) == len(targets), "two copies owed write one slot"
        read = [list(self.states.get(source, ())) for source, _ in copies]
        for (_, target), state in zip(copies, read):
            self.states[target] = state

    def write_state(self, seq, start, tokens):
        self.fork_copies()
        slot = seq.state_slot
        assert slot is not None, "a sequence computes tokens without a state slot"
        if start == 0:  # a chunk from position 0 starts from a zero state
            self.states[slot] = []
        assert self.states[slot] == seq.token_ids[:start], (
            f"slot {slot} holds the state of other tokens than sequence {seq.seq_id}'s")
        self.states[slot] = self.states[slot] + list(tokens)

    @invariant()
    def every_live_sequence_holds_a_slot_of_its_own(self):
        slots = self.manager.state_slots
        held = [seq.state_slot for seq in self.live]
        assert None not in held
        assert len(set(held)) == len(held), "a state slot shared by two live sequences"
        assert {slot: seq.seq_id for slot, seq in slots.owners.items()} == {
            seq.state_slot: seq.seq_id for seq in self.live}
        assert slots.num_free + len(held) == slots.num_slots

    @invariant()
    def each_slot_holds_its_sequences_computed_tokens(self):
        self.fork_copies()
        for seq in self.live:
            assert self.states[seq.state_slot] == seq.token_ids[:seq.num_computed_tokens]

    @invariant()
    def each_snapshot_holds_the_state_after_its_prefix(self):
        self.fork_copies()
        slots = self.manager.state_slots
        assert not set(slots.snapshots.values()) & set(slots.owners)
        for (_, _, tokens), slot in slots.snapshots.items():
            state = self.states[slot]
            assert state and len(state) % 4 == 0 and state[-4:] == list(tokens)

    def teardown(self):
        super().teardown()
        slots = self.manager.state_slots
        assert slots.num_free == slots.num_slots and not slots.owners, "a state slot leaked"


StateSlotMachine.TestCase.settings = BlockPoolMachine.TestCase.settings
test_state_slot_invariants = StateSlotMachine.TestCase
