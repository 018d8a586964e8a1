"""Sliding-window models served with their window: greedy tokens equal transformers' on
prompts shorter and longer than the window (8), through the C++ decoder stack and eager
layers, chunked prefill, both preemption modes, prefix caching and parallel samples."""

import random

import conftest
import pytest
import torch
from conftest import (
    SLIDING_WINDOW_ARCHITECTURES,
    TINY_WINDOW,
    first_token_ids,
    greedy_expectations,
    transformers_greedy,
)

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_groups import kv_cache_groups
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.models.attention import layer_windows

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make_prompts() -> list[list[int]]:
    """Shorter than the window, exactly it, a few windows long, and one sharing the long
    prompt's first 24 tokens (a prefix-cache candidate)."""
    rng = random.Random(29)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    long_prompt = tokens(37)
    return [tokens(5), tokens(TINY_WINDOW), long_prompt, long_prompt[:24] + tokens(6)]


PROMPTS = _make_prompts()


@pytest.fixture(scope="module")
def expected(tiny_model):
    """expected(arch): transformers' greedy continuation of every prompt (computed once)."""
    return greedy_expectations(tiny_model, PROMPTS, MAX_TOKENS)


# Gemma 4 runs its eager layers whatever enforce_eager says (gemma4.py says why).
EAGER_ONLY_ARCHITECTURES = ("gemma4",)
PATHS = [pytest.param(arch, eager, id=f"{arch}-{'eager' if eager else 'stack'}")
         for arch in SLIDING_WINDOW_ARCHITECTURES for eager in (False, True)
         if eager or arch not in EAGER_ONLY_ARCHITECTURES]


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize(("arch", "enforce_eager"), PATHS)
def test_greedy_matches_transformers(arch, block_size, enforce_eager, make_engine, eager_engine,
                                     run_engine, expected):
    engine = (eager_engine if enforce_eager else make_engine)(arch, block_size=block_size)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert engine.runner.fused_decoder_stack is not enforce_eager
    assert first_token_ids(run) == expected(arch)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", SLIDING_WINDOW_ARCHITECTURES)
def test_greedy_matches_transformers_with_chunked_prefill(arch, make_engine, run_engine,
                                                          expected):
    engine = make_engine(arch, block_size=4, max_num_batched_tokens=5)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == expected(arch)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", SLIDING_WINDOW_ARCHITECTURES)
def test_greedy_matches_transformers_under_preemption(arch, preemption_mode, make_engine,
                                                      tiny_model, run_engine, expected):
    # 14 blocks per KV cache group: a pool too small for the four prompts at once.
    groups = kv_cache_groups(layer_windows(tiny_model(arch).hf_model.config))
    engine = make_engine(arch, block_size=4, num_gpu_blocks_override=14 * len(groups),
                         max_model_len=48, max_num_batched_tokens=64,
                         preemption_mode=preemption_mode)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert engine.scheduler.num_preemptions > 0
    assert first_token_ids(run) == expected(arch)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", SLIDING_WINDOW_ARCHITECTURES)
def test_prefix_caching_keeps_greedy_output(arch, make_engine, run_engine, expected):
    engine = make_engine(arch, block_size=4)
    first = run_engine(engine, PROMPTS, GREEDY)
    second = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(first) == first_token_ids(second) == expected(arch)
    assert sum(output.num_cached_tokens for output in second.outputs) > 0


def test_parallel_samples_fork_the_windowed_blocks(make_engine, run_engine, expected):
    engine = make_engine("mistral-window", block_size=4)
    run = run_engine(engine, PROMPTS[2:3], SamplingParams(
        n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))

    assert [sample.token_ids for sample in run.outputs[0].outputs] == [expected(
        "mistral-window")[2]] * 3
    assert engine.kv_cache.pool.num_used_blocks == 0


def _engine_for(path_eager: bool, make_engine, eager_engine):
    return eager_engine if path_eager else make_engine


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize(("arch", "enforce_eager"), PATHS)
def test_kv_cache_groups_keep_greedy_output_through_every_feature(
        arch, enforce_eager, preemption_mode, enable_prefix_caching, make_engine, eager_engine,
        tiny_model, run_engine, expected):
    """Chunked prefill (chunks under the window), two greedy samples per prompt (forks and
    copy-on-write), a pool too small for the batch (preemption), prefix caching on or off
    and a second pass over the same prompts: every sample equals transformers', and every
    block and swap block comes back."""
    groups = kv_cache_groups(layer_windows(tiny_model(arch).hf_model.config))
    engine = _engine_for(enforce_eager, make_engine, eager_engine)(
        arch, block_size=4, num_gpu_blocks_override=12 * len(groups), max_model_len=48,
        max_num_batched_tokens=7, preemption_mode=preemption_mode, swap_space=0.01,
        enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):
        run = run_engine(engine, PROMPTS, params)
        assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
            [tokens, tokens] for tokens in expected(arch)]
    assert engine.scheduler.num_preemptions > 0
    if enable_prefix_caching:
        assert engine.kv_cache.prefix_stats.hits > 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert len(engine.kv_cache.free_swap_blocks) == engine.kv_cache.num_swap_blocks


@pytest.mark.parametrize("arch", ["qwen2-window", "gemma3", "gemma4"])
def test_beam_search_over_kv_cache_groups_equals_transformers(arch, make_engine, tiny_model):
    from test_beam_search import WIDTH, hf_beams, run_beam_search

    from kvscope.engine.orchestrator.beam_search import BeamSearchParams

    engine = make_engine(arch, block_size=4)
    for prompt in PROMPTS[1:3]:
        beams, _ = hf_beams(tiny_model(arch).hf_model, prompt, max_tokens=MAX_TOKENS)
        output = run_beam_search(engine, prompt, BeamSearchParams(WIDTH, MAX_TOKENS))
        assert [sample.token_ids for sample in output.outputs] == beams
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize(("arch", "enforce_eager"), [("qwen2-window", False), ("gemma3", True),
                                                    ("gemma4", True)])
def test_speculative_rollback_over_kv_cache_groups_keeps_greedy_output(
        arch, enforce_eager, make_engine, eager_engine, tiny_model, run_engine):
    """Proposals written into every group's blocks, the rejected ones rolled back."""
    from test_spec_decode import NGRAM, drafted

    prompts = [[3, 4, 5, 6] * 6, [7, 8] * 9 + [9]]  # repetitive: the n-gram proposer drafts
    engine = _engine_for(enforce_eager, make_engine, eager_engine)(
        arch, block_size=2, speculative_config=NGRAM)
    run = run_engine(engine, prompts, GREEDY)

    assert first_token_ids(run) == transformers_greedy(tiny_model(arch).hf_model, prompts, MAX_TOKENS)
    assert drafted(run)[0] > 0
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_gemma3_for_conditional_generation_serves_its_language_model(tmp_path, run_engine):
    """The checkpoint's vision tower is left out by name; the language model equals
    transformers' on text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = conftest._tiny_config("gemma3")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    conftest.save_tiny_model_files(model, tmp_path)
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05))
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == transformers_greedy(model, PROMPTS, MAX_TOKENS)
    # Gemma 3's two sliding layers and its global one: a block table each.
    assert engine.runner.group_windows == (TINY_WINDOW, TINY_WINDOW, None)


def test_gemma4_for_conditional_generation_serves_its_language_model(tmp_path, run_engine):
    """As Gemma 3's: the vision tower and its projection into the text are left out by name,
    the language model equals transformers' on text; it runs its eager layers though the C++
    stack is there (gemma4.py: one head shape per stack)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    text = conftest._tiny_config("gemma4")
    text.pad_token_id = 0  # the multimodal model pads image positions' per-layer inputs with it
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    conftest.save_tiny_model_files(model, tmp_path)
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05))
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == transformers_greedy(model, PROMPTS, MAX_TOKENS)
    assert not engine.runner.fused_decoder_stack


def test_gemma4_layers_of_two_shapes_share_the_pool_and_its_shared_layers_own_no_cache(
        make_engine):
    """The tiny Gemma 4's sliding layers (2 KV heads of 16) and full ones (1 of 48) each view
    their part of a slot as wide as the widest (48 values a token); its last two layers read
    the first two's caches, so only those two are bound to the pool."""
    runner = make_engine("gemma4", block_size=4).runner
    model = runner.model
    assert runner.attention_layers == [layer.self_attn.attn for layer in model.model.layers[:2]]
    assert [layer.self_attn.attn for layer in model.model.layers[2:]] == runner.attention_layers
    sliding, full = runner.attention_layers
    assert sliding.key_cache.shape[2:] == (2, 16) and full.key_cache.shape[2:] == (1, 48)
    assert runner.kv_cache.shape[-2:] == (1, 48)
    assert runner.bytes_per_block(4) == 2 * runner.layers_per_block * 4 * 48 * 4
    for layer in runner.attention_layers:
        assert layer.key_cache.untyped_storage().data_ptr() == (
            runner.kv_cache.untyped_storage().data_ptr())
