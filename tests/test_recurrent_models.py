"""Models with recurrent layers (their state in slots, engine.core.state_slots): greedy
tokens equal transformers' through chunked prefill (the state carried across chunks),
preemption (the state rebuilt by the re-prefill), parallel samples (each child its own
slot, copied from the parent's) and a batch decoding together; the settings such a model
cannot honour are turned off with a warning or refused."""

import logging
import random

import pytest
import torch
import transformers
from conftest import (
    RECURRENT_ARCHITECTURES,
    TINY_MAX_POSITIONS,
    _tiny_config,
    first_token_ids,
    greedy_expectations,
    save_tiny_model_files,
    transformers_greedy,
)

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.models.lfm2 import Lfm2ForCausalLM
from kvscope.engine.worker.models.qwen3_5 import Qwen3_5ForCausalLM

MODELS = {"lfm2": Lfm2ForCausalLM, "qwen3_5": Qwen3_5ForCausalLM}

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make_prompts() -> list[list[int]]:
    """One token, a few, one long prompt and one sharing its first 24 tokens."""
    rng = random.Random(31)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    long_prompt = tokens(37)
    return [tokens(1), tokens(6), long_prompt, long_prompt[:24] + tokens(6)]


PROMPTS = _make_prompts()


@pytest.fixture(scope="module")
def expected(tiny_model):
    return greedy_expectations(tiny_model, PROMPTS, MAX_TOKENS)


def assert_every_slot_back(engine) -> None:
    slots = engine.kv_cache.state_slots
    assert slots.num_free == slots.num_slots and not slots.owners
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_greedy_matches_transformers(arch, make_engine, run_engine, expected):
    """Four prompts at once: after their prefills they decode as one batch. A second pass
    takes the slots the first one left: a new sequence starts from a zero state."""
    engine = make_engine(arch, block_size=4)
    for _ in range(2):
        run = run_engine(engine, PROMPTS, GREEDY)
        assert first_token_ids(run) == expected(arch)
        assert max(sum(chunk[2] == "decode" for chunk in record.chunks)
                   for record in run.records) == len(PROMPTS)
    assert_every_slot_back(engine)


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_chunked_prefill_carries_the_state_across_chunks(arch, make_engine, run_engine,
                                                         expected):
    engine = make_engine(arch, block_size=4, max_num_batched_tokens=5)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == expected(arch)
    assert_every_slot_back(engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_preemption_rebuilds_the_state(arch, preemption_mode, make_engine, run_engine,
                                       expected, caplog):
    """A pool too small for the four prompts at once; swap preempts by recompute, saying
    so (the swap pool holds no state slots)."""
    with caplog.at_level(logging.WARNING):
        engine = make_engine(arch, block_size=4, num_gpu_blocks_override=14,
                             max_model_len=48, max_num_batched_tokens=64,
                             preemption_mode=preemption_mode)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert engine.scheduler.num_preemptions > 0
    assert first_token_ids(run) == expected(arch)
    assert engine.config.preemption_mode == "recompute"
    assert ("preemption_mode='swap'" in caplog.text) is (preemption_mode == "swap")
    assert_every_slot_back(engine)


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_parallel_samples_each_get_a_copy_of_the_parents_state(arch, make_engine, run_engine,
                                                               expected):
    """n=3 greedy samples of each prompt, prefilled in chunks: the children fork after the
    prompt, each with its own slot holding the parent's state, and all decode alike."""
    engine = make_engine(arch, block_size=4, max_num_batched_tokens=7)
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run = run_engine(engine, PROMPTS, params)

    assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
        [tokens] * 3 for tokens in expected(arch)]
    assert_every_slot_back(engine)


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_async_scheduling_keeps_greedy_output(arch, make_engine, run_engine, expected):
    """The next step is scheduled while a forward runs: a fork's copy still happens before
    the parent's next forward moves its state on."""
    engine = make_engine(arch, block_size=4, async_scheduling=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run = run_engine(engine, PROMPTS, params)

    assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
        [tokens] * 2 for tokens in expected(arch)]
    assert_every_slot_back(engine)


def test_the_memory_plan_gives_every_running_sequence_a_slot(make_engine):
    """The slots come out of the same budget as the blocks (test_memory.py: capping
    max_num_seqs where they do not all fit)."""
    engine = make_engine("lfm2", block_size=4, max_num_seqs=6)
    plan = engine.memory_plan
    per_slot = engine.runner.bytes_per_state_slot()
    # Three conv layers, each keeping conv_L_cache - 1 = 2 inputs of 64 channels in fp32.
    assert per_slot == 3 * 64 * 2 * 4 == plan.bytes_per_state_slot
    assert plan.num_state_slots == engine.kv_cache.state_slots.num_slots == 6
    assert all(layer.states["conv"].shape == (6, 64, 2) for layer in engine.runner.state_layers)
    assert (plan.num_blocks * plan.bytes_per_block + plan.num_state_slots * per_slot
            <= plan.device_memory_bytes * plan.gpu_memory_utilization
            - plan.weight_bytes - plan.peak_activation_bytes)
    assert f"state slots: 6 x {per_slot} bytes" in plan.describe()


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_prefix_caching_restores_the_state_snapshot(arch, enable_prefix_caching, make_engine,
                                                    run_engine, expected):
    """Chunked prefill (chunks ending on the snapshot boundaries, every 2 blocks), two
    greedy samples per prompt, a pool small enough to preempt, and a second pass over the
    same prompts: with caching on, the second pass's prefixes skip their KV and their
    recurrence (restored from snapshots), and every sample still equals transformers'."""
    engine = make_engine(arch, block_size=4, num_gpu_blocks_override=24, max_model_len=48,
                         max_num_batched_tokens=11, state_snapshot_every_n_blocks=2,
                         enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cached = []
    for _ in range(2):
        run = run_engine(engine, PROMPTS, params)
        assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
            [tokens, tokens] for tokens in expected(arch)]
        cached.append(sum(output.num_cached_tokens for output in run.outputs))
    assert engine.scheduler.num_preemptions > 0
    if enable_prefix_caching:
        assert cached[1] > 0 and cached[1] % 8 == 0  # hits end on a snapshot boundary
        assert engine.kv_cache.state_slots.snapshots
    else:
        assert cached == [0, 0]
    assert not engine.kv_cache.state_slots.owners
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_a_prefix_hit_on_a_snapshot_taken_the_step_before(arch, make_engine, run_engine,
                                                          expected):
    """The same prompt twice, the second admitted the step after the first's chunk ended
    on a snapshot boundary: its restore copies the state whose snapshot copy is still
    owed (both happen before the first's next chunk moves its state on)."""
    engine = make_engine(arch, block_size=4, max_num_batched_tokens=8,
                         state_snapshot_every_n_blocks=2)
    run = run_engine(engine, [PROMPTS[2]] * 2, GREEDY)

    assert first_token_ids(run) == [expected(arch)[2]] * 2
    assert run.outputs[1].num_cached_tokens > 0


def test_the_disk_tier_is_left_off_naming_the_setting(make_engine, tmp_path, caplog):
    """The tier saves blocks, not state slots: a block loaded from it could not skip the
    recurrence, so a recurrent model runs without the tier and says so."""
    with caplog.at_level(logging.WARNING):
        engine = make_engine("lfm2", block_size=4, kv_offload_dir=str(tmp_path),
                             kv_offload_gb=0.01)
    assert engine.kv_tier is None
    assert "kv_offload_dir=" in caplog.text and "recurrent layers" in caplog.text


def test_speculative_decoding_is_refused_naming_the_setting(make_engine):
    with pytest.raises(ValueError, match="speculative_config: Lfm2ForCausalLM has recurrent"):
        make_engine("lfm2", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_max": 2})


def test_a_recurrent_draft_model_is_refused_naming_the_setting(tiny_model):
    """The draft's proposals are rolled back as the target's are: a draft with recurrent
    layers could not."""
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*the draft "
                                         r"Lfm2ForCausalLM has recurrent layers"):
        EngineCore(EngineConfig(model=str(tiny_model("llama").path), dtype="float32",
                                device="cpu", device_memory_gb=0.05,
                                speculative_config={"model": str(tiny_model("lfm2").path),
                                                    "num_speculative_tokens": 2}))


@pytest.mark.parametrize(("arch", "change", "named"), [
    ("lfm2", {"conv_L_cache": 1}, "conv_L_cache=1"),
    ("lfm2", {"layer_types": ["conv", "sliding_attention", "conv", "conv"]},
     r"layer_types \['sliding_attention'\]"),
    ("qwen3_5", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim=1"),
    ("qwen3_5", {"linear_num_value_heads": 3}, "linear_num_value_heads=3 must be a multiple"),
])
def test_a_recurrent_layer_kvscope_cannot_run_is_refused_naming_its_field(arch, change, named):
    config = _tiny_config(arch)
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=named):
        MODELS[arch](config, TINY_MAX_POSITIONS, TINY_MAX_POSITIONS)


@pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES)
def test_beam_search_forks_the_state_with_the_beams(arch, make_engine, tiny_model):
    """Beams fork and are dropped every step: each keeps a slot holding its own history's
    state, and the beams and scores are transformers'."""
    from test_beam_search import MAX_TOKENS as BEAM_TOKENS
    from test_beam_search import WIDTH, hf_beams, run_beam_search

    from kvscope.engine.orchestrator.beam_search import BeamSearchParams

    engine = make_engine(arch, block_size=4)
    for prompt in PROMPTS[1:3]:
        beams, _ = hf_beams(tiny_model(arch).hf_model, prompt)
        output = run_beam_search(engine, prompt, BeamSearchParams(WIDTH, BEAM_TOKENS))
        assert [c.token_ids for c in output.outputs] == beams
    assert_every_slot_back(engine)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5-moe"])
def test_qwen3_5_as_published_serves_its_language_model(arch, tmp_path, run_engine):
    """Qwen3.5's checkpoints are Qwen3_5(Moe)ForConditionalGeneration: the vision tower
    ("model.visual.*") is left out by name and the language model equals transformers' on
    text, its multimodal rotary carrying text positions only."""
    prefix = "Qwen3_5Moe" if arch == "qwen3_5-moe" else "Qwen3_5"
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
        out_hidden_size=_tiny_config(arch).hidden_size, num_position_embeddings=16)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=_tiny_config(arch).to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    save_tiny_model_files(model, tmp_path)
    assert any(name.startswith("model.visual.") for name in model.state_dict())
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05, max_model_len=TINY_MAX_POSITIONS))
    run = run_engine(engine, PROMPTS, GREEDY)

    assert first_token_ids(run) == transformers_greedy(model, PROMPTS, MAX_TOKENS)
    assert isinstance(engine.runner.model, MODELS["qwen3_5"])
    assert_every_slot_back(engine)
