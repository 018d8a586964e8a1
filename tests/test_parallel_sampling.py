"""Parallel sampling (n > 1): one prefill, shared prompt blocks, copy-on-write, seeded samples."""

import random

import pytest

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_recorder import mirror_of

N = 4
SEED = 11
_rng = random.Random(8)
PROMPT = [_rng.randrange(1, 256) for _ in range(21)]  # ends in a partly filled block


def sampled(n=N, seed=SEED, max_tokens=10):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def samples(output) -> list[list[int]]:
    return [c.token_ids for c in sorted(output.outputs, key=lambda c: c.index)]


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_sample_i_equals_a_lone_request_seeded_s_plus_i(block_size, make_engine, run_engine):
    """Whether the prompt ends mid-block (copy-on-write) or not, and however many blocks
    the samples share, sample i is what seed + i gives alone."""
    engine = make_engine("llama", block_size=block_size)
    together = run_engine(engine, [PROMPT], sampled()).outputs[0]
    alone = run_engine(engine, [PROMPT] * N,
                       [sampled(n=1, seed=SEED + i) for i in range(N)]).outputs

    assert [c.index for c in together.outputs] == list(range(N))
    assert samples(together) == [samples(o)[0] for o in alone]
    assert len({tuple(s) for s in samples(together)}) == N  # the seeds did differ
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_prompt_blocks_are_shared_n_ways_and_never_modified_by_a_child(make_engine):
    block_size = 4
    engine = make_engine("llama", block_size=block_size)
    kv_cache = engine.runner.kv_cache
    request = engine.add_request(PROMPT, sampled())
    num_prompt_blocks = -(-len(PROMPT) // block_size)
    num_full_blocks = len(PROMPT) // block_size

    def prompt_rows(seq):
        """K and V of the prompt's positions as this sample's block table finds them."""
        positions = range(len(PROMPT))
        return kv_cache[:, :, [seq.block_table[p // block_size] for p in positions],
                        [p % block_size for p in positions]].clone()

    engine.step()  # the prefill; the request forks into N samples
    snapshot = mirror_of(engine).snapshot()
    tables = [s.block_table for s in snapshot.sequences]
    assert len(tables) == N and all(t == tables[0] for t in tables)
    assert len(tables[0]) == num_prompt_blocks
    assert all(snapshot.blocks[b].ref_count == N and snapshot.blocks[b].state == "shared"
               for b in tables[0])
    assert snapshot.blocks_saved_by_sharing == (N - 1) * num_prompt_blocks

    full_blocks = list(tables[0][:num_full_blocks])
    full_block_kv = kv_cache[:, :, full_blocks].clone()
    expected_rows = prompt_rows(request.sequences[0])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        live = [s for s in request.sequences if not s.is_finished]
        for seq in live:
            assert prompt_rows(seq).equal(expected_rows), seq.seq_id
            assert seq.block_table[:num_full_blocks] == full_blocks
        assert kv_cache[:, :, full_blocks].equal(full_block_kv)
        if live:
            # The partly filled prompt block was copied: each sample writes its own.
            last = [seq.block_table[num_prompt_blocks - 1] for seq in live]
            assert len(set(last)) == len(live)
            snapshot = mirror_of(engine).snapshot()
            assert all(snapshot.blocks[b].ref_count == len(live) for b in full_blocks)
            assert snapshot.blocks_saved_by_sharing == (len(live) - 1) * num_full_blocks
    assert steps == 9
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_samples_preempted_for_memory_still_equal_their_uncontended_selves(
        preemption_mode, make_engine, run_engine):
    params = [sampled(max_tokens=24), sampled(n=2, seed=3, max_tokens=24)]
    prompts = [PROMPT, PROMPT[:9]]
    expected = run_engine(make_engine("llama", block_size=4), prompts, params).outputs

    engine = make_engine("llama", block_size=4, num_gpu_blocks_override=16, max_model_len=48,
                         max_num_batched_tokens=64, preemption_mode=preemption_mode,
                         swap_space=0.001)
    run = run_engine(engine, prompts, params)

    assert engine.scheduler.num_preemptions > 0
    assert [samples(o) for o in run.outputs] == [samples(o) for o in expected]
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert len(engine.kv_cache.free_swap_blocks) == engine.kv_cache.num_swap_blocks


def test_n_whose_blocks_cannot_fit_the_pool_is_refused(make_engine, run_engine):
    engine = make_engine("llama", block_size=16, num_gpu_blocks_override=6, max_model_len=64,
                         max_num_batched_tokens=64)
    # A 21-token prompt needs 2 blocks, plus one copy-on-write block per extra sample.
    with pytest.raises(ValueError, match=r"n=8.*needs 9 KV blocks.*pool has 6"):
        engine.add_request(PROMPT, sampled(n=8))
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_used_blocks == 0
    # The largest n that fits still runs, and the engine is unharmed.
    output = run_engine(engine, [PROMPT], sampled(n=5, max_tokens=4)).outputs[0]
    assert len(output.outputs) == 5


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_n_below_one_or_not_an_integer_is_refused(n):
    with pytest.raises(ValueError, match=r"n=.*must be an integer >= 1"):
        SamplingParams(n=n)
