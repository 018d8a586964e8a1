"""The scheduler's step loop: preemption never makes it skip or rerun a sequence, and the
fair default for chunked prefill cannot livelock."""

import random

from conftest import make_sequence

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_no_running_sequence_silently_misses_a_step_when_an_earlier_one_is_the_victim(
        make_engine):
    """Regression: the victim used to be removed from `running` while the loop indexed it,
    so the sequence after it missed that step. Here a beam search of lower importance is
    queued first, so its beams sit early in `running` and are the preemption victims of
    the greedy requests behind them."""
    engine = make_engine("llama", block_size=4, num_gpu_blocks_override=20, max_model_len=48,
                         max_num_batched_tokens=512, enable_prefix_caching=False,
                         scheduling_policy="priority")
    rng = random.Random(0)
    engine.add_request([rng.randrange(1, 256) for _ in range(14)], BeamSearchParams(3, 10),
                       priority=1)
    for length in (9, 13, 6):
        engine.add_request([rng.randrange(1, 256) for _ in range(length)], GREEDY)

    victims = 0
    while engine.has_unfinished_requests():
        # (Sequences with nothing to compute, as beams awaiting their siblings once were
        # in `running`, are not expected to run.)
        before = [s for s in engine.scheduler.running if s.num_computed_tokens < s.num_tokens]
        record = engine.step().record
        scheduled = {seq_id for _, seq_id, *_ in record.chunks}
        victims += len(record.preempted)
        for seq in before:  # the budget never runs out here: each must run or be preempted
            assert seq.seq_id in scheduled or seq.seq_id in record.preempted, (
                f"step {record.step}: {seq.seq_id} was neither run nor preempted")
        assert len(scheduled) == len(record.chunks)  # nobody runs twice in a step
    assert victims > 0
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_a_victim_later_in_running_is_not_scheduled_after_its_preemption():
    """The loop walks a snapshot of `running`: a sequence preempted by an earlier one is
    skipped when its turn comes, and everyone else still runs."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, max_model_len=64,
                          enable_prefix_caching=False, scheduling_policy="priority")
    kv_cache = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    scheduler = Scheduler(config, kv_cache)
    first, victim, last = (make_sequence([1, 2, 3, 4, 5, 6, 7, 8]) for _ in range(3))
    victim.request.priority = 1  # the least important
    for seq in (first, victim, last):
        scheduler.add(seq)
    scheduler.schedule()  # each prompt takes 2 blocks: the pool is full
    for seq in (first, victim, last):  # every prompt sampled: the next token needs a block
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(9)

    out = scheduler.schedule()

    assert out.preempted == [victim]
    assert [item.seq for item in out.scheduled] == [first, last]
    assert scheduler.running == [first, last] and list(scheduler.waiting) == [victim]
    assert kv_cache.pool.num_free_blocks == 0


def test_fair_default_cannot_livelock_in_a_tiny_pool_with_recompute(make_engine, run_engine):
    """Recompute without a prefix cache, in a pool one long sequence nearly fills, with the
    fair default cap on prefill chunks (no knob set): every request still finishes, with
    the outputs it has alone. The head of `running` is never a victim while others are
    there, so it always finishes, and then the next one does."""
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (50, 7, 33, 12, 41, 5, 20)]
    params = [GREEDY, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12,
                                     ignore_eos=True)] * 4
    knobs = {"block_size": 8, "max_model_len": 72, "max_num_batched_tokens": 32,
             "enable_prefix_caching": False}
    alone = [run_engine(make_engine("llama", **knobs), [p], [sp]).outputs[0]
             for p, sp in zip(prompts, params)]

    engine = make_engine("llama", num_gpu_blocks_override=10, preemption_mode="recompute",
                         **knobs)
    run = run_engine(engine, prompts, params[:len(prompts)])

    assert engine.scheduler.num_preemptions > 0
    assert any(end - start == 8 for r in run.records for *_, start, end in r.chunks)  # capped
    assert ([[c.token_ids for c in o.outputs] for o in run.outputs]
            == [[c.token_ids for c in o.outputs] for o in alone])
    assert engine.kv_cache.pool.num_used_blocks == 0
