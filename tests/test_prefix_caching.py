"""Automatic prefix caching: exact hits, LRU eviction, revival, collisions, and the KV it hands out."""

import itertools
import random

import pytest
from conftest import make_sequence
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvscope.engine.core.kv_cache_manager as kv_cache_manager_module
from kvscope import LLM
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import Sequence
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_recorder import mirror_of

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def run_one_by_one(engine, prompts, params=GREEDY):
    """Each prompt runs to the end before the next is added (so its blocks are cached)."""
    outputs = []
    for prompt in prompts:
        request_id = engine.add_request(prompt, params).request_id
        while engine.has_unfinished_requests():
            for output in engine.step().outputs:
                if output.finished and output.request_id == request_id:
                    outputs.append(output)
    return outputs


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in output.outputs] for output in outputs]


# ---- the engine with the cache on and off ------------------------------------------------
def test_caching_on_and_off_give_identical_outputs(make_engine, run_engine):
    """A shared system prompt, asked concurrently and then again one by one, with chunked
    prefill cutting through cached and uncached blocks; greedy and seeded sampling."""
    rng = random.Random(7)
    system = tokens(rng, 37)
    prompts = [system + tokens(rng, n) for n in (1, 5, 11, 24, 40)]
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=2)] * 3
    params = params[:len(prompts)]
    results = {}
    for enabled in (False, True):
        engine = make_engine("llama", block_size=8, max_num_batched_tokens=32,
                             enable_prefix_caching=enabled)
        together = run_engine(engine, prompts, params)
        one_by_one = [run_engine(engine, [p], sp).outputs[0] for p, sp in zip(prompts, params)]
        results[enabled] = (token_ids(together.outputs), token_ids(one_by_one),
                            [o.num_cached_tokens for o in one_by_one])
        assert engine.kv_cache.pool.num_used_blocks == 0
        stats = engine.kv_cache.prefix_stats
        assert (stats.hits > 0) is enabled

    assert results[True][:2] == results[False][:2]
    assert results[False][2] == [0] * len(prompts)
    # One by one, each prompt finds at least the system prompt's 4 full blocks of 8.
    assert all(cached >= 32 for cached in results[True][2])


def test_three_prompts_sharing_five_blocks_hit_exactly_80_tokens(make_engine):
    engine = make_engine("llama", block_size=16)
    rng = random.Random(1)
    shared = tokens(rng, 80)
    # Suffixes that differ from their first token on, one of them a whole block long.
    suffixes = [[1] + tokens(rng, 6), [2] + tokens(rng, 15), [3] + tokens(rng, 22)]
    prompts = [shared + suffix for suffix in suffixes]
    outputs = run_one_by_one(engine, prompts)

    assert [o.num_cached_tokens for o in outputs] == [0, 80, 80]
    stats = engine.kv_cache.prefix_stats
    assert stats.queries == sum(len(p) for p in prompts)
    assert stats.hits == 160
    assert stats.hit_rate == pytest.approx(160 / stats.queries)
    snapshot = mirror_of(engine).snapshot()
    assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (stats.queries, 160)
    cached = {b.token_ids for b in snapshot.blocks if b.state == "cached"}
    assert {tuple(shared[i:i + 16]) for i in range(0, 80, 16)} <= cached


def test_counters_count_prompt_tokens_queried_and_found(make_engine):
    engine = make_engine("llama", block_size=16)
    rng = random.Random(2)
    prompt = tokens(rng, 40)
    run_one_by_one(engine, [prompt, prompt, prompt[:20]])
    stats = engine.kv_cache.prefix_stats
    assert stats.queries == 100
    assert stats.hits == 32 + 16  # 2 blocks (one token is always computed), then 1 block


def test_each_block_counts_its_prefix_hits_and_forks_are_not_hits(make_engine):
    """The mirror's per-block hits (the prefix tree's "hits" per node) are the times a
    later prompt found that block: the 40-token prompt's first block is found by both
    later prompts, its second by the full repeat only; a fork (n=2) shares without a hit,
    and an evicted block's count goes with its content."""
    engine = make_engine("llama", block_size=16, num_gpu_blocks_override=8, max_model_len=128)
    rng = random.Random(2)
    prompt = tokens(rng, 40)
    run_one_by_one(engine, [prompt, prompt, prompt[:20]])
    run_one_by_one(engine, [tokens(rng, 33)], SamplingParams(n=2, max_tokens=1))
    mirror = mirror_of(engine)
    hits = {mirror.block_info(int(b)).token_ids: int(mirror.hit_counts[b])
            for b in range(mirror.num_blocks) if mirror.hashed[b]}
    assert hits[tuple(prompt[:16])] == 2 and hits[tuple(prompt[16:32])] == 1
    assert sum(hits.values()) == 3  # the n=2 prompt's blocks: shared by a fork, not hit
    run_one_by_one(engine, [tokens(rng, 100)], ONE_TOKEN)  # evicts every cached block
    assert not mirror_of(engine).hit_counts.any()


def test_a_chat_reuses_its_history_turn_after_turn(tiny_chat_model_path):
    knobs = dict(dtype="float32", device="cpu", device_memory_gb=0.05, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=12)
    transcripts = {}
    for enabled in (True, False):
        llm = LLM(str(tiny_chat_model_path), enable_prefix_caching=enabled, **knobs)
        messages = [{"role": "system", "content": "You are a terse assistant. " * 3},
                    {"role": "user", "content": "What is a paged KV cache?"}]
        turns = []
        for turn in range(3):
            output = llm.chat(messages, params, use_tqdm=False)[0]
            turns.append((len(output.prompt_token_ids), output.num_cached_tokens,
                          output.outputs[0].token_ids))
            messages += [{"role": "assistant", "content": output.outputs[0].text},
                         {"role": "user", "content": f"And then? ({turn})"}]
        transcripts[enabled] = turns

    turns = transcripts[True]
    assert turns[0][1] == 0
    for previous, current in itertools.pairwise(turns):
        # The new prompt starts with the whole previous prompt: all its full blocks hit.
        assert current[1] >= previous[0] // 16 * 16
        assert current[1] > previous[1]
    assert [t[2] for t in turns] == [t[2] for t in transcripts[False]]
    assert [t[1] for t in transcripts[False]] == [0, 0, 0]


# ---- LRU, revival, collisions, eviction ---------------------------------------------------
def test_eviction_takes_the_least_recently_used_blocks(make_engine):
    """A and B are cached, then A is used again: the pressure of D evicts B, not A
    (first-in-first-out would evict A, which was cached first)."""
    engine = make_engine("llama", block_size=16, num_gpu_blocks_override=8, max_model_len=128)
    rng = random.Random(3)
    a, b, d = tokens(rng, 33), tokens(rng, 33), tokens(rng, 90)
    run_one_by_one(engine, [a, b], ONE_TOKEN)
    assert run_one_by_one(engine, [a], ONE_TOKEN)[0].num_cached_tokens == 32
    assert engine.kv_cache.pool.num_evictions == 0
    run_one_by_one(engine, [d], ONE_TOKEN)  # needs every plain block and two cached ones

    assert engine.kv_cache.pool.num_evictions == 2
    cached = {block.token_ids for block in mirror_of(engine).snapshot().blocks if block.state == "cached"}
    assert {tuple(a[:16]), tuple(a[16:32])} <= cached
    assert not {tuple(b[:16]), tuple(b[16:32])} & cached
    assert run_one_by_one(engine, [a], ONE_TOKEN)[0].num_cached_tokens == 32
    assert run_one_by_one(engine, [b], ONE_TOKEN)[0].num_cached_tokens == 0


def test_a_hit_revives_a_cached_free_block(make_engine):
    engine = make_engine("llama", block_size=16)
    rng = random.Random(4)
    first = tokens(rng, 33)
    run_one_by_one(engine, [first], ONE_TOKEN)
    before = mirror_of(engine).snapshot()
    cached_ids = [b.block_id for b in before.blocks
                  if b.state == "cached" and b.token_ids in (tuple(first[:16]), tuple(first[16:32]))]
    assert len(cached_ids) == 2

    request = engine.add_request(first[:32] + tokens(rng, 5), GREEDY)
    engine.step()
    after = mirror_of(engine).snapshot()
    (seq,) = after.sequences
    assert sorted(seq.block_table[:2]) == sorted(cached_ids)
    assert all(after.blocks[i].state == "used" and after.blocks[i].ref_count == 1
               for i in cached_ids)
    free_queue = {block.block_id for block in engine.kv_cache.pool.free_queue}
    assert not free_queue & set(cached_ids)
    assert after.count("cached") == before.count("cached") - 2
    assert request.num_cached_tokens == 32


def test_colliding_hashes_give_no_hit_and_correct_outputs(make_engine, run_engine, monkeypatch):
    rng = random.Random(5)
    a, b = tokens(rng, 48), tokens(rng, 48)
    prompts = [a, b, b, a]
    reference = run_one_by_one(make_engine("llama", enable_prefix_caching=False), prompts)

    monkeypatch.setattr(kv_cache_manager_module, "hash_block_tokens",
                        lambda parent, token_ids, cache_salt=None: b"\x00" * 16)
    outputs = run_one_by_one(make_engine("llama"), prompts)

    assert token_ids(outputs) == token_ids(reference)
    # Every block hashes alike, so only a's first block (the first one cached, with no parent)
    # can be found: b's blocks and a's later ones do not match their token ids or parent.
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 16]


def test_eviction_never_takes_a_block_in_use(make_engine, run_engine):
    """A long request keeps decoding while short ones churn through a small pool; the
    blocks it holds keep their hash and their K/V, however many cached blocks are evicted."""
    rng = random.Random(6)
    long_prompt = tokens(rng, 40)
    shorts = [long_prompt[:8] + tokens(rng, 16) for _ in range(12)]
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    expected = run_engine(make_engine("llama", block_size=8), [long_prompt], long_params)

    engine = make_engine("llama", block_size=8, num_gpu_blocks_override=20, max_model_len=96)
    long_request = engine.add_request(long_prompt, long_params)
    pending = list(shorts)
    kv_cache = engine.runner.kv_cache
    seen_kv = None
    previous = mirror_of(engine).snapshot()
    while engine.has_unfinished_requests():
        if pending and engine.step_index % 2 == 0:
            for prompt in pending[:2]:
                engine.add_request(prompt, short_params)
            del pending[:2]
        engine.step()
        snapshot = mirror_of(engine).snapshot()
        for old, new in zip(previous.blocks, snapshot.blocks):
            if old.ref_count > 0 and new.ref_count > 0 and old.block_hash is not None:
                assert new.block_hash == old.block_hash
        previous = snapshot
        seq = long_request.sequences[0]
        if seq.is_finished:
            continue
        # The long request's K/V rows, position by position, never change once written.
        table, computed = seq.block_table, seq.num_computed_tokens
        rows = kv_cache[:, :, [table[p // 8] for p in range(computed)],
                        [p % 8 for p in range(computed)]].clone()
        if seen_kv is not None:
            assert rows[:, :, :seen_kv.shape[2]].equal(seen_kv)
        seen_kv = rows

    assert engine.kv_cache.pool.num_evictions > 0
    assert long_request.sequences[0].num_preemptions == 0
    assert long_request.sequences[0].output_token_ids == expected.outputs[0].outputs[0].token_ids
    assert engine.kv_cache.pool.num_used_blocks == 0


# ---- random interleavings on the KV cache manager ------------------------------------------
BLOCK_SIZE = 4
class CacheMachine(RuleBasedStateMachine):
    """Random allocate / advance (prefill chunk or decode) / fork / free / evict against a
    simulated device: each block holds the token each slot was written with, so a missed
    copy-on-write, a wrong prefix hit or an evicted block in use shows up as a sequence
    whose K/V no longer spell its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=14, block_size=BLOCK_SIZE)
        self.device: dict[int, list[int | None]] = {
            i: [None] * BLOCK_SIZE for i in range(14)}
        self.live: list[Sequence] = []
        self.fresh_tokens = itertools.count(1000)  # tokens no prompt uses: never hit

    # -- the device side of a step --------------------------------------------------------
    def compute(self, seq: Sequence, num_tokens: int, cached_prefix=()) -> bool:
        """What a step does: blocks (with copy-on-write), then write the tokens' K/V."""
        pool = self.manager.pool
        start = seq.num_computed_tokens + len(cached_prefix) * BLOCK_SIZE
        written = range(start // BLOCK_SIZE, (start + num_tokens - 1) // BLOCK_SIZE + 1)
        shared = {i: seq.block_table[i] for i in written
                  if i < len(seq.block_table) and pool.blocks[seq.block_table[i]].ref_count > 1}
        before = [(b.ref_count, b.block_hash) for b in pool.blocks]
        copies = self.manager.allocate_slots(seq, num_tokens, list(cached_prefix))
        if copies is None:
            assert [(b.ref_count, b.block_hash) for b in pool.blocks] == before
            return False
        # Every write into a shared block was announced as a copy, to a block of its own.
        assert sorted(copies) == sorted((old, seq.block_table[i]) for i, old in shared.items())
        for source, target in copies:
            self.device[target] = list(self.device[source])
        assert seq.num_computed_tokens == start
        for position in range(start, start + num_tokens):
            block = pool.blocks[seq.block_table[position // BLOCK_SIZE]]
            assert block.ref_count == 1, "a block with ref > 1 was written"
            self.device[block.block_id][position % BLOCK_SIZE] = seq.token_ids[position]
        seq.num_computed_tokens = start + num_tokens
        self.manager.cache_full_blocks(seq)
        return True

    # -- rules ------------------------------------------------------------------------------
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=18),
          chunk=st.integers(1, 18))
    def allocate(self, prompt, chunk):
        seq = make_sequence(prompt)
        cached_prefix = self.manager.find_cached_prefix(seq)
        remaining = seq.num_tokens - len(cached_prefix) * BLOCK_SIZE
        if self.compute(seq, min(chunk, remaining), cached_prefix):
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_tokens=st.integers(1, 6), token=st.integers(0, 2))
    def advance(self, data, num_tokens, token):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:  # decode: one new token
            seq.token_ids.append(token)
        # A refused step changes nothing (checked in compute): the sequence just waits.
        self.compute(seq, min(num_tokens, seq.num_tokens - seq.num_computed_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = make_sequence(parent.token_ids)
        self.manager.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.manager.free(seq)
        self.live.remove(seq)

    @rule()
    def evict(self):
        """A prompt of never-seen tokens takes every free block, evicting each cached one."""
        pool = self.manager.pool
        count = pool.num_free_blocks
        if count == 0:
            return
        in_use = {b.block_id: b.block_hash for b in pool.blocks if b.ref_count > 0}
        seq = make_sequence([next(self.fresh_tokens) for _ in range(count * BLOCK_SIZE)])
        assert self.compute(seq, seq.num_tokens)
        assert not set(seq.block_table) & set(in_use)
        assert all(pool.blocks[i].block_hash == h for i, h in in_use.items())
        assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 0
        self.manager.free(seq)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def blocks_are_partitioned_and_counted(self):
        pool = self.manager.pool
        used = sum(1 for b in pool.blocks if b.ref_count > 0)
        cached = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
        free = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is None)
        assert free + cached + used == pool.num_blocks
        assert (pool.num_used_blocks, pool.num_cached_free_blocks) == (used, cached)
        assert len(pool.free_queue) == free + cached
        holders = [0] * pool.num_blocks
        for seq in self.live:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [b.ref_count for b in pool.blocks] == holders

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.live:
            stored = [self.device[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                      for p in range(seq.num_computed_tokens)]
            assert stored == seq.token_ids[:seq.num_computed_tokens], seq.seq_id

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        pool = self.manager.pool
        for block in map(pool.blocks.__getitem__, pool.cached_blocks.values()):
            assert tuple(self.device[block.block_id]) == block.block_hash[2]

    def teardown(self):
        for seq in self.live:
            self.manager.free(seq)
        assert self.manager.pool.num_used_blocks == 0
        assert self.manager.pool.num_free_blocks == self.manager.pool.num_blocks


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_random_interleavings_keep_the_cache_consistent = CacheMachine.TestCase
