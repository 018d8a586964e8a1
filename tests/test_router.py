"""The router, its prefix index and the block events feeding it, and the router's
predicted hits against the actual ones, without Ray."""

import dataclasses

import pytest
from conftest import make_sequence

from kvscope.engine.core.block_pool import hash_block_tokens
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.replicas import prefix_index
from kvscope.engine.replicas.hit_outcomes import (
    HitLedger,
    HitOutcome,
    HitTotals,
    MissReason,
    reusable_blocks,
)
from kvscope.engine.replicas.prefix_index import PrefixIndex, prompt_block_hashes
from kvscope.engine.replicas.replica import BlockHashTracker, CachedPrefixes, ReplicaEvents
from kvscope.engine.replicas.router import ReplicaLoad, Router
from kvscope.engine.replicas.router_view import IndexComparison, RouterView, compare_index
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


def test_prompt_hashes_carry_the_requests_cache_salt_as_the_prefix_cache_does() -> None:
    """A salted request is routed by the hashes its replica will cache it under (the salt in
    the first block, so every block differs from the unsalted prompt's)."""
    tokens = list(range(10))
    seq = make_sequence(tokens)
    seq.request.cache_salt = "tenant-a"
    cached = [value for value, _, _ in KVCacheManager(num_blocks=4, block_size=4)
              .prompt_block_hashes(seq)]
    salted = prompt_block_hashes(tokens, 4, "tenant-a")
    assert salted == cached
    assert not set(salted) & set(prompt_block_hashes(tokens, 4))


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


def test_predicted_hits_settle_against_actual_ones_and_say_why_they_missed() -> None:
    clock = Clock()
    index = PrefixIndex(clock)
    ledger = HitLedger(index)
    hashes = prompt_block_hashes(list(range(16)), 4)  # 4 full blocks, 16 tokens
    index.apply(0, stored=hashes[:2], evicted=[], event_seq=2)
    router = Router(index)

    def route(request_id: str) -> HitOutcome:
        decision = router.choose(request_id, hashes, idle(0))
        return ledger.open(request_id, 0, decision.matched_blocks, hashes, 16, 4)

    # Confirmed blocks 0-1, guessed 2-3 (the first routing notes them); the last block
    # holds the last token, which a replica always computes: 3 blocks predicted.
    first = route("a")
    assert (first.predicted_tokens, first.confirmed_blocks) == (0 + 8, 2)  # before the note
    second = route("b")
    assert (second.predicted_tokens, second.confirmed_blocks) == (12, 2)
    clock.now += 1
    index.apply(0, stored=[], evicted=[hashes[1]], event_seq=3)
    third = route("c")
    assert third.predicted_tokens == 4  # block 1 gone, the chain stops
    ledger.settle("a", 8)  # as predicted
    ledger.settle("b", 4)  # block 1 was evicted after b was routed
    ledger.settle("c", 0)  # block 0 is still held: not reused by the replica
    ledger.abandon("d")  # never opened: ignored
    fourth = route("e")
    ledger.settle("e", 4)  # block 1, the first guess after the held block 0, never stored
    fifth = route("f")
    ledger.settle("f", fifth.predicted_tokens + 4)  # a block the index did not know
    assert [o.reason for o in (first, second, third, fourth, fifth)] == [
        None, MissReason.EVICTED, MissReason.NOT_REUSED, MissReason.NOT_STORED_YET, None]
    assert ledger.settle("a", 8) is None  # settled once
    totals = ledger.totals
    assert totals.requests == 5 and totals.misses == 3
    assert totals.predicted_tokens == 8 + 12 + 4 + fourth.predicted_tokens + fifth.predicted_tokens
    assert totals.actual_tokens == 8 + 4 + 0 + 4 + fifth.predicted_tokens + 4
    assert totals.predicted_tokens - totals.missed_tokens == (
        totals.actual_tokens - totals.unforeseen_tokens)
    assert totals.misses_by_reason == {"evicted": 1, "not reused": 1, "not stored yet": 1}
    assert totals.since(HitTotals()) == totals
    later = dataclasses.replace(totals, misses_by_reason=dict(totals.misses_by_reason))
    route("g")
    ledger.settle("g", 0)
    assert ledger.totals.since(later).misses_by_reason == {"not reused": 1}
    assert reusable_blocks(16, 4) == 3 and reusable_blocks(17, 4) == 4
    assert reusable_blocks(0, 4) == 0


def test_the_index_beside_a_replicas_cache_shows_the_differences_and_the_lag() -> None:
    clock = Clock()
    index = PrefixIndex(clock)
    hashes = prompt_block_hashes(list(range(24)), 4)  # 6 blocks
    assert compare_index(index, CachedPrefixes(0, frozenset(hashes[:2]), 2)) == IndexComparison(
        0, 0, 0, 2, 0, 2, None, None)  # nothing heard from the replica yet
    index.apply(0, stored=hashes[:4], evicted=[], event_seq=4)
    index.note_routed(0, hashes)  # blocks 4 and 5: guesses
    clock.now += 2.5
    truth = CachedPrefixes(0, frozenset(hashes[1:3] + hashes[4:5]), 7)
    assert compare_index(index, truth) == IndexComparison(
        replica=0, believed_blocks=4, guessed_blocks=2, cached_blocks=3,
        believed_but_evicted=2, cached_but_unknown=1, age_s=2.5, events_behind=3)
    index.apply(0, stored=hashes[4:5], evicted=[hashes[0], hashes[3]], event_seq=9)
    caught_up = compare_index(index, truth)  # the poll came after the answer
    assert (caught_up.believed_but_evicted, caught_up.cached_but_unknown) == (0, 0)
    assert (caught_up.age_s, caught_up.events_behind) == (0.0, 0)


def test_the_router_panel_shows_the_counters_the_sums_and_the_misses() -> None:
    from kvscope.ui.replicas import UNFORESEEN, belief_markdown, miss_rows, settled_totals

    index = PrefixIndex(Clock())
    ledger = HitLedger(index)
    hashes = prompt_block_hashes(list(range(16)), 4)
    index.apply(0, stored=hashes, evicted=[], event_seq=4)
    for request_id, actual in (("hit", 12), ("short", 4), ("pending", None)):
        ledger.open(request_id, 0, 4, hashes, 16, 4)
        if actual is not None:
            ledger.settle(request_id, actual)
    ledger.open("more", 1, 0, hashes, 16, 4)
    ledger.settle("more", 8)
    view = RouterView(4, (compare_index(index, CachedPrefixes(0, frozenset(hashes), 6)),),
                      tuple(ledger.recent), ledger.totals)
    assert settled_totals(view.outcomes) == ledger.totals
    markdown = belief_markdown(view)
    assert "3 requests settled): predicted **24**, actual **24**" in markdown
    assert "misses 1 (not reused 1)" in markdown
    assert "| 0 | 4 | 0 | 4 | 0 | 0 | 0.0 s | 2 |" in markdown
    assert miss_rows(view) == [["more", 1, 16, 0, 8, UNFORESEEN],
                               ["short", 0, 16, 12, 4, "not reused"]]
