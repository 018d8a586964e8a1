"""The router, its prefix index and the block events feeding it, without Ray."""

import pytest

from kvscope.engine.core.block_pool import hash_block_tokens
from kvscope.engine.replicas import prefix_index
from kvscope.engine.replicas.prefix_index import PrefixIndex, prompt_block_hashes
from kvscope.engine.replicas.replica import BlockHashTracker, ReplicaEvents
from kvscope.engine.replicas.router import ReplicaLoad, Router
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_recorder import PoolRecorder


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def idle(*replicas: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica, 0, 0.0, 8) for replica in replicas]


def test_prompt_hashes_are_the_prefix_caches_chained_hashes() -> None:
    tokens = list(range(10))
    first = hash_block_tokens(None, (0, 1, 2, 3))
    assert prompt_block_hashes(tokens, 4) == [first, hash_block_tokens(first, (4, 5, 6, 7))]
    assert prompt_block_hashes(tokens[:3], 4) == []
    assert prompt_block_hashes([1, "x", 2, 3], 4) == []  # refused later by the replica


def test_kv_aware_goes_where_the_prefix_is_and_matches_stop_at_the_first_miss() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(16)), 4)
    index.apply(1, stored=hashes[:3], evicted=[])
    index.apply(0, stored=hashes[1:], evicted=[])  # without block 0 nothing after it counts
    decision = Router(index).choose("r", hashes, idle(0, 1))
    assert decision.replica == 1 and decision.matched_blocks == 3
    assert {c.replica: c.matched_blocks for c in decision.candidates} == {0: 0, 1: 3}
    index.apply(1, stored=[], evicted=[hashes[1]])
    assert index.matched_blocks(1, hashes) == 1


def test_idle_replicas_take_new_prefixes_in_turn_under_kv_aware() -> None:
    """A prompt no replica holds goes to the emptier cache: new tenants spread out."""
    index = PrefixIndex()
    router = Router(index)
    first, second = (prompt_block_hashes([tenant] * 16, 4) for tenant in (1, 2))
    assert router.choose("a", first, idle(0, 1)).replica == 0
    index.apply(0, stored=first, evicted=[])
    decision = router.choose("b", second, idle(0, 1))
    assert decision.replica == 1 and decision.matched_blocks == 0
    assert router.choose("c", first, idle(0, 1)).replica == 0  # a match still wins


def test_load_weight_trades_hits_against_balance() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(16)), 4)
    index.apply(0, stored=hashes, evicted=[])
    busy = [ReplicaLoad(0, 8, 0.5, 8), ReplicaLoad(1, 0, 0.0, 8)]  # loads 1.5 and 0
    assert Router(index, load_weight=0.5).choose("a", hashes, busy).replica == 0
    router = Router(index, load_weight=1.0)
    decision = router.choose("b", hashes, busy)
    assert decision.replica == 1
    assert [c.score for c in decision.candidates] == pytest.approx([1 - 1.5, 0.0])


def test_least_loaded_and_round_robin_ignore_the_prefix() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(8)), 4)
    index.apply(0, stored=hashes, evicted=[])
    loads = [ReplicaLoad(0, 3, 0.0, 8), ReplicaLoad(1, 1, 0.0, 8), ReplicaLoad(2, 2, 0.0, 8)]
    assert Router(index, "least-loaded").choose("a", hashes, loads).replica == 1
    router = Router(index, "round-robin")
    assert [router.choose(str(i), hashes, loads).replica for i in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="routing="):
        Router(index, "random")
    with pytest.raises(ValueError, match="routing_load_weight="):
        Router(index, load_weight=-1)


def test_a_routed_prefix_sticks_until_its_blocks_are_confirmed_or_it_expires() -> None:
    clock = Clock()
    index = PrefixIndex(clock)
    router = Router(index)
    hashes = prompt_block_hashes(list(range(8)), 4)
    first = router.choose("a", hashes, idle(0, 1))
    # A burst of the same prefix before the replica reported any block: it sticks.
    assert all(router.choose(str(i), hashes, idle(0, 1)).replica == first.replica
               for i in range(3))
    clock.now += prefix_index.ROUTED_PREFIX_TTL_S + 1
    assert index.matched_blocks(first.replica, hashes) == 0  # never stored: forgotten
    index.apply(first.replica, stored=hashes, evicted=[])
    assert index.matched_blocks(first.replica, hashes) == 2
    index.drop(first.replica)
    assert index.matched_blocks(first.replica, hashes) == 0


def test_block_events_follow_the_pool_the_prefix_cache_holds(make_engine) -> None:
    """The replica's tracker turns the engine's pool records into stored / evicted hashes
    that equal the chained hashes the router computes for the same prompt."""
    core = make_engine("llama", block_size=4, num_gpu_blocks_override=12, max_model_len=48,
                       max_num_batched_tokens=48)
    recorder, tracker, index = PoolRecorder(core).listen(), BlockHashTracker(), PrefixIndex()

    def feed(records) -> None:
        for record in records:
            events = ReplicaEvents()
            assert tracker.apply(record, events)
            index.apply(0, events.stored, events.evicted)

    feed(recorder.take_full())
    first = list(range(1, 17))  # 4 full blocks
    core.add_request(first, SamplingParams(max_tokens=1))
    while core.has_unfinished_requests():
        core.step()
        feed([recorder.take_delta()])
    hashes = prompt_block_hashes(first, 4)
    assert index.matched_blocks(0, hashes) == 4
    # Another prompt needing every block evicts the first one's cached blocks.
    core.add_request(list(range(100, 144)), SamplingParams(max_tokens=1))
    while core.has_unfinished_requests():
        core.step()
        feed([recorder.take_delta()])
    held = set(core.kv_cache.pool.cached_blocks)  # hash values the pool holds now
    leading = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
    assert index.matched_blocks(0, hashes) == leading < 4
    assert index.num_blocks(0) == len(held)


def test_a_poll_of_many_pool_records_leaves_the_index_equal_to_the_pool(make_engine) -> None:
    """A replica's poll carries every record since the last one in one batch: a block
    stored in one step and evicted in a later one must not stay in the index."""
    core = make_engine("llama", block_size=4, num_gpu_blocks_override=12, max_model_len=48,
                       max_num_batched_tokens=48)
    recorder, tracker, index = PoolRecorder(core).listen(), BlockHashTracker(), PrefixIndex()
    batch = ReplicaEvents()
    for record in recorder.take_full():
        assert tracker.apply(record, batch)
    for prompt in (list(range(1, 17)), list(range(100, 144)), list(range(1, 17))):
        core.add_request(prompt, SamplingParams(max_tokens=1))
        while core.has_unfinished_requests():
            core.step()
            assert tracker.apply(recorder.take_delta(), batch)
    index.apply(0, batch.stored, batch.evicted, tracker.event_seq)
    assert index.held(0) == set(core.kv_cache.pool.cached_blocks)
    # Every change counts as an event, the folded ones too.
    assert tracker.event_seq > len(batch.blocks)
