"""A prefix-cache miss on tokens the cache had seen says why: evicted (by which request, in
which step), cached under another cache_salt, or a shared text that ends mid-block; and the
bookkeeping behind it stays bounded."""

import pytest
from conftest import session_log_round_trip

from kvscope.engine.core.block_pool import BlockPool, hash_block_tokens
from kvscope.engine.core.prefix_misses import RECENT_ENTRIES, BoundedLRU, Eviction
from kvscope.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture
def engine(make_engine):
    """Ten blocks, one request at a time: each request's blocks are decided by the one
    before it alone."""
    return make_engine("llama", block_size=BLOCK_SIZE, num_gpu_blocks_override=10,
                       max_model_len=40, max_num_seqs=1, max_num_batched_tokens=64,
                       enable_prefix_caching=True)


def run(engine, prompt: list[int], request_id: str, cache_salt: str | None = None) -> list:
    engine.add_request(prompt, ONE_TOKEN, request_id=request_id, cache_salt=cache_salt)
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step().record)
    return records


def misses(records) -> list[tuple]:
    return [miss for record in records for miss in record.prefix_misses]


def test_an_evicted_prefix_names_the_request_and_step_that_evicted_it(engine):
    prompt = list(range(10, 22))  # three full blocks, cached after its prefill
    assert misses(run(engine, prompt, "first")) == []
    # Ten blocks for a new prompt: every cached block of the first goes.
    evictor_records = run(engine, list(range(100, 139)), "evictor")
    (evicting_step,) = [record.step for record in evictor_records
                        for request_id, *_ in record.chunks if request_id == "evictor"]
    records = run(engine, prompt, "again")
    # The lookup covers all but the last token: two blocks, both evicted.
    (seq_id,) = {seq_id for request_id, seq_id, *_ in records[0].chunks}
    assert misses(records) == [(seq_id, "evicted", 2 * BLOCK_SIZE, "evictor", evicting_step)]
    assert engine.kv_cache.pool.evicted.get(hash_block_tokens(None, tuple(prompt[:4])))


def test_an_eviction_planned_a_step_ahead_names_the_step_it_ran_in(make_engine):
    """Async scheduling plans step n + 1 while step n runs: the evictor, admitted while
    another request decodes, evicts in a plan made ahead."""
    engine = make_engine("llama", block_size=BLOCK_SIZE, num_gpu_blocks_override=10,
                         max_model_len=40, max_num_seqs=2, max_num_batched_tokens=64,
                         enable_prefix_caching=True, async_scheduling=True)
    prompt = list(range(10, 22))
    run(engine, prompt, "first")
    # One block all its life, so only the evictor evicts.
    engine.add_request([5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       request_id="decoding")
    records = [engine.step().record]
    records += run(engine, list(range(100, 132)), "evictor")  # 8 blocks: 2 evicted
    (evicting_step,) = [record.step for record in records for request_id, *_, start, _
                        in record.chunks if request_id == "evictor" and start == 0]
    (miss,) = misses(run(engine, prompt, "again"))
    assert miss[1:] == ("evicted", BLOCK_SIZE, "evictor", evicting_step)


def test_a_shared_text_ending_mid_block_is_a_partial_block(engine):
    prompt = list(range(10, 24))
    run(engine, prompt, "first")
    # Shares 10 tokens: two full blocks hit, and 2 tokens of the third cannot.
    records = run(engine, prompt[:10] + [200, 201, 202, 203, 204], "diverging")
    assert records[0].chunks[0][3] == 2 * BLOCK_SIZE  # the two full blocks were hits
    (miss,) = misses(records)
    assert miss[1:] == ("partial_block", 2, None, None)


def test_the_same_tokens_under_another_salt_are_a_salt_mismatch(engine):
    prompt = list(range(10, 22))  # the lookup covers two full blocks
    run(engine, prompt, "first", cache_salt="tenant-a")
    same_salt = run(engine, prompt, "same-salt", cache_salt="tenant-a")
    assert same_salt[0].chunks[0][3] == 2 * BLOCK_SIZE and misses(same_salt) == []
    other_salt = run(engine, prompt, "other-salt", cache_salt="tenant-b")
    assert other_salt[0].chunks[0][3] == 0  # never shared across salts
    assert [miss[1:] for miss in misses(other_salt)] == [
        ("salt_mismatch", 2 * BLOCK_SIZE, None, None)]
    # Unsalted is a salt of its own: it misses what tenant-b cached last.
    unsalted = run(engine, prompt, "unsalted")
    assert unsalted[0].chunks[0][3] == 0
    assert [miss[1] for miss in misses(unsalted)] == ["salt_mismatch"]
    # And its blocks are the unsalted hashes: a salt never changes an unsalted prompt's.
    assert engine.kv_cache.pool.lookup(hash_block_tokens(None, tuple(prompt[:4])),
                                       tuple(prompt[:4])) is not None


def test_a_salt_mismatch_counts_only_what_the_other_salt_still_holds(engine):
    """tenant-a's blocks evicted: a tenant-b prompt is a plain new prompt (nothing cached
    to miss), not a salt mismatch."""
    prompt = list(range(10, 22))
    run(engine, prompt, "first", cache_salt="tenant-a")
    run(engine, list(range(100, 139)), "evictor")  # ten blocks: every cached one goes
    assert misses(run(engine, prompt, "other-salt", cache_salt="tenant-b")) == []


@pytest.mark.parametrize("salt", [3, "", b"a", ["a"]])
def test_a_bad_cache_salt_is_refused_naming_it(engine, salt):
    with pytest.raises(ValueError, match="cache_salt=.*must be a non-empty string"):
        engine.add_request([1, 2, 3], ONE_TOKEN, cache_salt=salt)
    assert not engine.has_unfinished_requests()


def test_a_full_hit_and_a_new_prompt_carry_no_miss(engine):
    prompt = list(range(10, 23))  # three full blocks, one token past them
    run(engine, prompt, "first")
    assert misses(run(engine, prompt, "same")) == []
    assert misses(run(engine, [230 + i for i in range(9)], "new")) == []


def test_misses_round_trip_the_session_log(engine, tmp_path):
    prompt = list(range(10, 24))
    run(engine, prompt, "first")
    records = run(engine, prompt[:10] + [200, 201, 202, 203, 204], "diverging")
    records += run(engine, prompt, "salted", cache_salt="tenant-a")
    stored = session_log_round_trip(records, engine.config.to_dict(), tmp_path)
    assert stored == records
    assert [miss[1] for miss in misses(stored)] == ["partial_block", "salt_mismatch"]


def test_the_eviction_memory_stays_bounded():
    pool = BlockPool(2)
    evictor = Eviction("r", 0)
    parent = None
    for index in range(RECENT_ENTRIES + 100):
        (block,) = pool.allocate(1, evictor)
        value = hash_block_tokens(parent, (index,))
        pool.cache(block, (value, parent, (index,)), 0)
        pool.release([block])
        parent = value
    assert len(pool.evicted) == RECENT_ENTRIES
    assert len(pool.followers) == RECENT_ENTRIES
    # The oldest went first: the newest evictions are the ones remembered.
    assert pool.evicted.get(hash_block_tokens(None, (0,))) is None


def test_bounded_lru_keeps_the_most_recently_put():
    lru = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    lru.put("a", 3)  # refreshed: "b" is now the oldest
    lru.put("c", 4)
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (3, None, 4, 2)
    with pytest.raises(ValueError, match="capacity"):
        BoundedLRU(0)
