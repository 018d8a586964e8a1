"""kv_cache_dtype: the knob, the pool it sizes, the blocks that carry their scales, the
next-token distributions over a quantized cache against the model-dtype one (teacher-forced,
position by position), and greedy decoding over it through the engine's paths (the kernels
themselves are held to the oracle in tests/test_kernels.py)."""

import random

import pytest
import torch
from conftest import make_sequence

from kvscope.engine.config import KV_CACHE_DTYPES, EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import kv_quant, reference

QUANTIZED = ["fp8", "fp8_e5m2", "int8"]
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (6, 17, 30, 11, 9, 24, 3, 14)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Per format: (least top-1 agreement, most mean KL in nats) with the auto cache over
# TEACHER's positions. Measured on the tiny llama (the C++ and torch backends alike): int8
# 0.997 / 6.9e-8, fp8 (e4m3) 0.984 / 1.7e-6, fp8_e5m2 0.956 / 5.4e-6; int8 cut to 3 bits
# (codes -3..3) 0.850 / 1.4e-4, which fails every bound. The tiny random model's
# distributions are nearly flat (the best two tokens a median 0.035 nats apart), so its KLs
# are small and a flipped near-tie costs top-1 agreement; the KL bounds leave each format
# 5-7x room, the top-1 bounds 2-3 points.
AGREEMENT = {"int8": (0.99, 5e-7), "fp8": (0.97, 1e-5), "fp8_e5m2": (0.93, 3e-5)}


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


# Four sequences of 80 random tokens: 320 positions, each scored given the true tokens before it.
TEACHER = [[_rng.randrange(1, 256) for _ in range(80)] for _ in range(4)]
PREFILL = 16  # the first tokens of each sequence go in one chunk, the rest one by one


@torch.inference_mode()
def teacher_forced_logprobs(engine) -> torch.Tensor:
    """The next-token log-probabilities [positions, vocab] at every position of TEACHER, its
    tokens forced through the engine's runner and paged cache: one PREFILL-token chunk per
    sequence (the prefill path), then a forward per position with one token of each
    sequence (decodes, each reading every key before it from the cache)."""
    runner, kv = engine.runner, engine.kv_cache
    seqs = [make_sequence(tokens) for tokens in TEACHER]
    logits = [[] for _ in seqs]
    for start, end in [(0, PREFILL)] + [(p, p + 1) for p in range(PREFILL, len(TEACHER[0]))]:
        for seq in seqs:
            assert kv.allocate_slots(seq, end - start) is not None
        rows = runner.forward_rows([(start, end, seq.block_table) for seq in seqs],
                                   [seq.token_ids[start:end] for seq in seqs],
                                   list(range(len(seqs) * (end - start))))
        for index, seq in enumerate(seqs):
            logits[index].append(rows[index * (end - start):(index + 1) * (end - start)])
            seq.num_computed_tokens = end
    for seq in seqs:
        kv.free(seq)
    return torch.log_softmax(torch.cat([torch.cat(rows) for rows in logits]).double(), dim=-1)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_next_token_distributions_agree_with_auto_at_every_position(make_engine,
                                                                    kv_cache_dtype):
    """Over 320 teacher-forced positions, the quantized cache's next-token distribution
    against the model-dtype cache's: the share of positions whose most likely token is the
    same, and the mean KL divergence KL(auto || quantized), each held to its format's bound."""
    auto = teacher_forced_logprobs(make_engine("llama"))
    quantized = teacher_forced_logprobs(make_engine("llama", kv_cache_dtype=kv_cache_dtype))
    assert auto.shape[0] == 320
    top1 = (auto.argmax(-1) == quantized.argmax(-1)).double().mean().item()
    kl = (auto.exp() * (auto - quantized)).sum(-1).mean().item()
    least_top1, most_kl = AGREEMENT[kv_cache_dtype]
    assert top1 >= least_top1 and kl <= most_kl, (
        f"kv_cache_dtype={kv_cache_dtype}: top-1 agreement {top1:.3f} (at least {least_top1}), "
        f"mean KL {kl:.2e} nats (at most {most_kl:.0e})")


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
