"""kv_cache_dtype: the knob, the pool it sizes, the blocks that carry their scales, and greedy
decoding over a quantized cache against the model-dtype one (the kernels themselves are held
to the oracle in tests/test_kernels.py)."""

import random

import pytest
import torch

from kvscope.engine.config import KV_CACHE_DTYPES, EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import kv_quant, reference

QUANTIZED = ["fp8", "fp8_e5m2", "int8"]
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (6, 17, 30, 11, 9, 24, 3, 14)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Greedy tokens must agree with the auto cache up to auto's first step whose two best tokens
# lie within NEAR_TIE nats: a tiny random model's logits are nearly flat (its best two often
# ~0.01 nats apart), and a quantized cache moves that gap by up to ~0.007 nats here (per-row
# rounding of K/V by at most 1/16 of a value for fp8_e4m3, 1/8 for fp8_e5m2, 1/254 of the row's
# largest for int8), so a smaller gap may flip and every token after a flip differs. Past that
# step nothing is promised (bench/kv_dtype.py measures the real model's first divergence).
NEAR_TIE = 0.02


def tokens(run) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in run.outputs]


def test_knob_names_its_choices():
    assert KV_CACHE_DTYPES == tuple(kv_quant.CODE_DTYPES)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4' must be one of \['auto', 'fp8'"):
        EngineConfig(kv_cache_dtype="fp4")


def test_quantizer_rounds_within_its_format(tmp_path):
    rows = torch.randn(64, 3, 48) * torch.logspace(-3, 2, 64)[:, None, None]
    amax = rows.abs().amax(-1, keepdim=True)
    for dtype, relative in ((torch.int8, None), (torch.float8_e4m3fn, 2 ** -4),
                            (torch.float8_e5m2, 2 ** -3)):
        cached = kv_quant.quantize(rows, dtype)
        assert cached.shape == (64, 3, 48 + kv_quant.SCALE_ELEMENTS)
        error = (kv_quant.dequantize(cached, torch.float32) - rows).abs()
        step = kv_quant.scales(cached).unsqueeze(-1)
        if relative is None:  # half an int8 step, the step a bf16 scale of amax / 127
            assert bool((error <= step / 2 * 1.0001).all())
            assert bool((step <= amax / 127 * (1 + 2 ** -8)).all())
        else:  # half an ulp of the code, or the subnormal step below the normal range
            bound = torch.maximum(rows.abs() * relative, step * 2 ** -9)
            assert bool((error <= bound * 1.0001).all())
    zeros = kv_quant.quantize(torch.zeros(2, 8), torch.int8)
    assert not kv_quant.dequantize(zeros, torch.float32).any()


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_pool_grows_by_the_byte_ratio(make_engine, kv_cache_dtype):
    auto = make_engine("llama").memory_plan
    engine = make_engine("llama", kv_cache_dtype=kv_cache_dtype)
    plan, runner = engine.memory_plan, engine.runner
    head_dim = runner.attention_layers[0].head_dim  # every layer's, in this model
    # fp32 model: 4 bytes per value against one code, plus a 2-byte scale per row
    assert plan.bytes_per_block * 4 * head_dim == auto.bytes_per_block * (head_dim + 2)
    assert (plan.auto_bytes_per_block, plan.auto_num_blocks) == (auto.bytes_per_block,
                                                                 auto.num_blocks)
    ratio = auto.bytes_per_block / plan.bytes_per_block
    assert abs(plan.num_blocks - auto.num_blocks * ratio) <= ratio + 1
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == plan.kv_cache_bytes
    assert f"kv_cache_dtype {kv_cache_dtype}" in plan.describe()


def decided_prefix(completion) -> int:
    """Tokens before the first step whose two best logprobs lie within NEAR_TIE."""
    for step, top in enumerate(completion.logprobs):
        best, second = sorted(top.values(), reverse=True)[:2]
        if best - second < NEAR_TIE:
            return step
    return len(completion.token_ids)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_greedy_agrees_with_auto_for_a_bounded_prefix(make_engine, run_engine, kv_cache_dtype):
    with_margins = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    auto = [o.outputs[0] for o in run_engine(make_engine("llama"), PROMPTS, with_margins).outputs]
    quantized = tokens(run_engine(make_engine("llama", kv_cache_dtype=kv_cache_dtype),
                                  PROMPTS, GREEDY))
    prefixes = [decided_prefix(completion) for completion in auto]
    assert sum(prefixes) >= 8  # the check covers tokens, not only near ties
    for completion, prefix, got in zip(auto, prefixes, quantized, strict=True):
        assert got[:prefix] == list(completion.token_ids[:prefix])


def test_fused_stack_and_eager_layers_agree_over_an_int8_cache(make_engine, run_engine):
    fused = make_engine("llama", kv_cache_dtype="int8")
    assert fused.runner.fused_decoder_stack
    stack = tokens(run_engine(fused, PROMPTS, GREEDY))
    eager = tokens(run_engine(make_engine("llama", kv_cache_dtype="int8", enforce_eager=True),
                              PROMPTS, GREEDY))
    assert stack == eager


def test_prefix_hits_and_swaps_read_the_scales_written(make_engine, run_engine):
    """A prefix hit attends over blocks another request quantized, and a swapped sequence
    over blocks copied out and back: both must decode as an uncontended cold run does."""
    knobs = {"kv_cache_dtype": "int8", "block_size": 8, "max_model_len": 72}
    prompts = PROMPTS + [PROMPTS[2] + [7, 8, 9]]  # shares PROMPTS[2]'s full blocks
    cold = tokens(run_engine(make_engine("llama", enable_prefix_caching=False, **knobs),
                             prompts, GREEDY))
    engine = make_engine("llama", preemption_mode="swap", num_gpu_blocks_override=9,
                         swap_space=0.001, max_num_batched_tokens=64, **knobs)
    assert tokens(run_engine(engine, prompts[:-1], GREEDY)) == cold[:-1]
    assert engine.kv_cache.swap_stats.swap_ins > 0
    engine = make_engine("llama", **knobs)
    run_engine(engine, [PROMPTS[2]], GREEDY)
    hit = run_engine(engine, prompts[-1:], GREEDY)  # PROMPTS[2]'s blocks, as it left them
    assert tokens(hit) == cold[-1:] and hit.outputs[0].num_cached_tokens >= 24


def test_block_copies_move_codes_and_scales(make_engine):
    """Copy-on-write and swap out / in move whole rows, each row's scale inline."""
    runner = make_engine("llama", kv_cache_dtype="int8", block_size=4).runner
    runner.allocate_swap_space(2)
    layer = runner.attention_layers[0]
    key = torch.randn(4, layer.num_kv_heads, layer.head_dim) * 5
    reference.store_kv(key, -key, layer.key_cache, layer.value_cache, torch.arange(4, 8))
    written = layer.key_cache[1].clone()
    assert bool((kv_quant.scales(written) > 0).all())
    runner.copy_blocks([(1, 3)], runner.kv_cache, runner.kv_cache)  # copy-on-write
    runner.copy_blocks([(3, 1)], runner.kv_cache, runner.swap_cache)  # swap out
    runner.copy_blocks([(1, 5)], runner.swap_cache, runner.kv_cache)  # swap in
    for block in (3, 5):
        assert torch.equal(layer.key_cache[block], written)
        torch.testing.assert_close(kv_quant.dequantize(layer.value_cache[block], torch.float32),
                                   -kv_quant.dequantize(written, torch.float32))
