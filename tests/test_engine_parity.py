"""Greedy parity: the engine's tokens equal transformers' greedy generate, token for token."""

import random

import conftest
import pytest
import torch
from conftest import TINY_ARCHITECTURES as ARCHITECTURES
from conftest import first_token_ids, greedy_expectations, transformers_greedy

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make_prompts() -> list[list[int]]:
    """Shorter than a block, exactly a block (16 and 32), several blocks plus a partial one,
    and a prompt sharing its first 48 tokens with the longest (a prefix-cache candidate)."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    long_prompt = tokens(71)
    return [tokens(5), tokens(16), tokens(32), long_prompt, long_prompt[:48] + tokens(9)]


PROMPTS = _make_prompts()
LONGEST = PROMPTS.index(max(PROMPTS, key=len))


@pytest.fixture(scope="module")
def expected(tiny_model):
    """expected(arch): transformers' greedy continuation of every prompt (computed once)."""
    return greedy_expectations(tiny_model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, block_size, make_engine, run_engine, expected):
    engine = make_engine(arch, block_size=block_size)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == expected(arch)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in run.outputs)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize(("block_size", "num_blocks", "preemption_mode"),
                         [(1, 100, "recompute"), (16, 7, "recompute"), (16, 7, "swap")])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_under_preemption(
        arch, block_size, num_blocks, preemption_mode, make_engine, run_engine, expected):
    # The batch needs ~240 tokens of KV at its peak; the pool holds barely one long sequence.
    # (A small token budget also keeps the start-up profiling forward cheap.)
    engine = make_engine(arch, block_size=block_size, num_gpu_blocks_override=num_blocks,
                         max_model_len=96, max_num_batched_tokens=128,
                         preemption_mode=preemption_mode)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert engine.scheduler.num_preemptions > 0
    assert any(record.preempted for record in run.records)
    assert sum(o.metrics.num_preemptions for o in run.outputs) == engine.scheduler.num_preemptions
    if preemption_mode == "swap":
        assert engine.kv_cache.swap_stats.swap_outs > 0
    assert first_token_ids(run) == expected(arch)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_with_chunked_prefill(
        arch, budget, make_engine, run_engine, expected):
    engine = make_engine(arch, max_num_batched_tokens=budget)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == expected(arch)
    assert all(record.num_scheduled_tokens <= budget for record in run.records)
    longest_id = run.outputs[LONGEST].request_id
    prefill_chunks = [(start, end) for record in run.records
                      for request_id, _, kind, start, end in record.chunks
                      if request_id == longest_id and kind == "prefill"]
    assert len(prefill_chunks) > 1  # the 71-token prompt was split across steps
    assert prefill_chunks[-1][1] == len(PROMPTS[LONGEST])


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_caching_does_not_change_greedy_output(
        arch, enable_prefix_caching, make_engine, run_engine, expected):
    engine = make_engine(arch, enable_prefix_caching=enable_prefix_caching)
    first = run_engine(engine, PROMPTS, GREEDY)
    # The second pass finds the first pass's full blocks (if caching is on).
    second = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(first) == expected(arch)
    assert first_token_ids(second) == expected(arch)
    cached = [output.num_cached_tokens for output in second.outputs]
    if enable_prefix_caching:
        # Whole blocks of 16, and at least one prompt token is always computed.
        assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    else:
        assert cached == [0] * len(PROMPTS)
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_prefix_hit_inside_one_batch_after_the_sharing_prompt_finished(
        make_engine, run_engine, expected):
    """A later request reuses blocks an earlier request of the same engine left cached."""
    engine = make_engine("llama")
    long_prompt, sharing_prompt = PROMPTS[3], PROMPTS[4]
    run_engine(engine, [long_prompt], GREEDY)
    run = run_engine(engine, [sharing_prompt], GREEDY)

    assert run.outputs[0].num_cached_tokens == 48
    assert run.outputs[0].outputs[0].token_ids == expected("llama")[4]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parallel_greedy_samples_each_match_transformers(arch, make_engine, run_engine,
                                                         expected):
    """n=2 forks each prompt's blocks; every greedy sample still equals transformers'."""
    engine = make_engine(arch)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run = run_engine(engine, PROMPTS, params)

    assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
        [tokens, tokens] for tokens in expected(arch)]
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["ministral3"])
def test_eager_layers_match_transformers(arch, tiny_model, run_engine, expected):
    """The parity above runs the C++ decoder stack; a model whose eager layers compute a part
    of their own (Ministral 3's query scale) is held to transformers there too, with prompts
    chunked (budget 7) across the scale's steps."""
    engine = EngineCore(EngineConfig(model=str(tiny_model(arch).path), dtype="float32",
                                     device="cpu", device_memory_gb=0.05, enforce_eager=True,
                                     block_size=4, max_num_batched_tokens=7))
    run = run_engine(engine, PROMPTS, GREEDY)

    assert not engine.runner.fused_decoder_stack
    assert first_token_ids(run) == expected(arch)


def test_mistral3_for_conditional_generation_serves_its_language_model(tmp_path, run_engine):
    """Ministral 3 as published: a Mistral3ForConditionalGeneration, whose vision tower and
    projector are left out by name; its language model equals transformers' on text."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=16, image_size=28,
                                 patch_size=14)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=conftest._tiny_config("ministral3").to_dict(),
        vision_config=vision.to_dict(), tie_word_embeddings=False)).eval()
    conftest.save_tiny_model_files(model, tmp_path)
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05))
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == transformers_greedy(model, PROMPTS, MAX_TOKENS)
