"""Speculative decoding with a draft model: greedy output equals speculation off, the
draft's K/V stays in step with the target's through every block operation (a draft that
is a copy of the target has every proposal accepted), and bad drafts are refused at start."""

from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB_SIZE, noisy_output_copy, save_tiny_model_files
from test_spec_decode import (
    FEATURES,
    GREEDY,
    MIXED,
    PRESSURED,
    PROMPTS,
    SHORT_PROMPTS,
    drafted,
    token_ids,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.model_runner import ModelRunner

EAGER = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0, "adaptive_k": False}


def draft_config(path: Path, k: int = 3, **knobs) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **EAGER, **knobs}


def _small_llama(vocab_size: int = TINY_VOCAB_SIZE, max_positions: int = 256):
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> Path:
    """A one-layer random Llama, half the target's width, on the target's vocabulary."""
    folder = tmp_path_factory.mktemp("draft-small")
    save_tiny_model_files(_small_llama(), folder)
    return folder


@pytest.fixture(scope="module")
def noisy_draft(tiny_model, tmp_path_factory) -> Path:
    """The target's weights with noise on its output projection: it agrees with the
    target on some tokens and not on others, so proposals are both accepted and rejected."""
    folder = tmp_path_factory.mktemp("draft-noisy")
    save_tiny_model_files(noisy_output_copy(tiny_model("llama").hf_model, std=0.005, seed=3),
                          folder)
    return folder


@pytest.fixture(scope="module")
def copy_draft(tiny_model) -> Path:
    """The target itself, loaded a second time as the draft: with its K/V kept in step, it
    proposes exactly what the target then samples greedily."""
    return tiny_model("llama").path


def test_a_small_draft_leaves_greedy_output_unchanged(small_draft, make_engine, run_engine):
    off = run_engine(make_engine("llama", block_size=4), PROMPTS, GREEDY)
    engine = make_engine("llama", block_size=4, speculative_config=draft_config(small_draft))
    on = run_engine(engine, PROMPTS, GREEDY)

    assert token_ids(on) == token_ids(off)
    assert drafted(on)[0] > 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    plan = engine.memory_plan
    # One plan for both models; the draft's pool has a block for each of the target's.
    draft = engine.runner.proposer.runner
    assert plan.draft_weight_bytes == draft.weight_bytes > 0
    assert plan.bytes_per_block == (engine.runner.target.bytes_per_block(4)
                                    + plan.draft_bytes_per_block)
    assert draft.kv_cache.shape[2] == engine.runner.target.kv_cache.shape[2] == plan.num_blocks
    assert "of these the draft model's" in plan.describe()


def test_a_noisy_draft_is_verified_and_rolled_back(noisy_draft, make_engine, run_engine):
    off = run_engine(make_engine("llama", block_size=4), PROMPTS, GREEDY)
    on = run_engine(make_engine("llama", block_size=4,
                                speculative_config=draft_config(noisy_draft, k=4)),
                    PROMPTS, GREEDY)

    assert token_ids(on) == token_ids(off)
    proposed, accepted = drafted(on)
    assert 0.2 < accepted / proposed < 0.8
    assert len(on.records) < len(off.records)


@pytest.mark.parametrize("budget", [5, 64])
@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_the_drafts_kv_keeps_in_step_under_preemption_chunking_and_caching(
        preemption_mode, enable_prefix_caching, budget, copy_draft, noisy_draft, make_engine,
        run_engine):
    """Chunked prefill (a budget below a verification chunk), repeated preemption in both
    modes, the prefix cache on and off, and n=2 forks. A copy of the target as the draft
    proposes what the target picks only while its own K/V holds exactly the sequence's
    tokens: every proposal accepted shows it stayed in step. A noisy draft's rejections
    roll both pools back, and output stays equal."""
    knobs = {"block_size": 8, "max_model_len": 72, "max_num_batched_tokens": budget,
             "enable_prefix_caching": enable_prefix_caching}
    off = run_engine(make_engine("llama", **knobs), SHORT_PROMPTS, MIXED)
    for draft, all_accepted in ((copy_draft, True), (noisy_draft, False)):
        engine = make_engine("llama", **knobs, **PRESSURED, preemption_mode=preemption_mode,
                             speculative_config=draft_config(draft))
        on = run_engine(engine, SHORT_PROMPTS, MIXED)

        assert token_ids(on) == token_ids(off)
        assert engine.scheduler.num_preemptions >= 2
        proposed, accepted = drafted(on)
        assert proposed > 0 and (accepted == proposed) == all_accepted
        assert all(r.num_scheduled_tokens <= budget for r in on.records)
        assert engine.kv_cache.pool.num_used_blocks == 0
        assert sorted(engine.kv_cache.free_swap_blocks) == list(
            range(engine.kv_cache.num_swap_blocks))


def test_a_cached_prefix_carries_the_drafts_kv(copy_draft, make_engine, run_engine):
    """A second request over the same prompt starts from the first one's cached blocks:
    the draft reads their K/V without computing it, and still every proposal holds."""
    engine = make_engine("llama", block_size=4, speculative_config=draft_config(copy_draft))
    first = run_engine(engine, [SHORT_PROMPTS[2]], GREEDY)
    second = run_engine(engine, [SHORT_PROMPTS[2]], GREEDY)

    assert second.outputs[0].num_cached_tokens > 0
    assert token_ids(second) == token_ids(first)
    proposed, accepted = drafted(second)
    assert proposed > 0 and accepted == proposed


@pytest.mark.parametrize("knobs", FEATURES.values(), ids=FEATURES)
def test_sampling_features_apply_to_a_drafts_proposals(knobs, noisy_draft, make_engine,
                                                       run_engine):
    params = SamplingParams(temperature=0, max_tokens=40, **knobs)
    off = run_engine(make_engine("llama", block_size=4), PROMPTS, params)
    on = run_engine(make_engine("llama", block_size=4,
                                speculative_config=draft_config(noisy_draft)), PROMPTS, params)

    assert token_ids(on) == token_ids(off)
    assert [[(c.text, c.finish_reason, c.logprobs and [sorted(e) for e in c.logprobs])
             for c in o.outputs] for o in on.outputs] == \
        [[(c.text, c.finish_reason, c.logprobs and [sorted(e) for e in c.logprobs])
          for c in o.outputs] for o in off.outputs]
    assert drafted(on)[0] > 0  # (the draft knows no logit bias: there all are rejected)


def test_greedy_requests_beside_sampled_ones_keep_their_output(noisy_draft, make_engine,
                                                               run_engine):
    """Sampled requests' proposals carry their q; greedy ones beside them in the same
    verification rows carry none, and stay equal to speculation off."""
    sampled = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
    params = [GREEDY, sampled] * 3
    off = run_engine(make_engine("llama", block_size=4), PROMPTS, params)
    on = run_engine(make_engine("llama", block_size=4,
                                speculative_config=draft_config(noisy_draft)), PROMPTS, params)

    assert token_ids(on)[::2] == token_ids(off)[::2]
    assert all(len(c.token_ids) == 40 for o in on.outputs for c in o.outputs)
    sampled_drafts = [d for r in on.records for d in r.spec_drafts
                      if d[0] in {o.request_id for o in on.outputs[1::2]}]
    assert sum(d[1] for d in sampled_drafts) > 0 and sum(d[2] for d in sampled_drafts) > 0


def test_beam_search_beside_a_draft_model_is_unchanged(noisy_draft, make_engine, run_engine):
    params = [BeamSearchParams(3, 12), GREEDY]
    prompts = PROMPTS[1:3]
    off = run_engine(make_engine("llama", block_size=4), prompts, params)
    on = run_engine(make_engine("llama", block_size=4,
                                speculative_config=draft_config(noisy_draft)), prompts, params)

    assert token_ids(on) == token_ids(off)
    assert all(d[0].startswith(on.outputs[1].request_id) for r in on.records
               for d in r.spec_drafts)
    assert drafted(on)[0] > 0


def _other_tokenizer_draft(folder: Path) -> Path:
    """The target's vocabulary size, but token i is spelled <<i>>."""
    _small_llama().save_pretrained(folder)
    core = Tokenizer(models.WordLevel({f"<<{i}>>": i for i in range(TINY_VOCAB_SIZE)},
                                      unk_token="<<0>>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("make_draft", "message"), [
    (lambda folder: save_tiny_model_files(_small_llama(vocab_size=128), folder) or folder,
     "the draft's vocab_size=128 differs from the target's vocab_size=256"),
    (_other_tokenizer_draft, "the draft's tokenizer maps tokens to other ids"),
    (lambda folder: save_tiny_model_files(_small_llama(max_positions=64), folder) or folder,
     "the draft's max_position_embeddings=64 is below max_model_len=256"),
    (lambda folder: folder / "missing", "does not load"),
], ids=["vocab-size", "tokenizer", "positions", "missing"])
def test_a_draft_that_cannot_stand_in_is_refused_at_start(make_draft, message, tiny_model,
                                                          tmp_path):
    draft = make_draft(tmp_path)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*" + message):
        EngineCore(EngineConfig(model=str(tiny_model("llama").path), dtype="float32",
                                device="cpu", device_memory_gb=0.05,
                                speculative_config=draft_config(draft)))


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "draft_model"}, "speculative_config.model=None: method='draft_model' needs"),
    ({"method": "ngram", "model": "small"}, "method='ngram' takes no model"),
    ({"model": "small", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be"),
    ({"model": "small", "num_speculative_tokens": 17}, "num_speculative_tokens=17 must be"),
    ({"method": "eagle", "model": "small"}, "speculative_config.method='eagle' must be one of"),
])
def test_bad_draft_model_configs_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=spec)


def test_model_without_method_means_draft_model():
    assert EngineConfig(speculative_config={"model": "small"}).speculative_config.method == \
        "draft_model"
    assert EngineConfig(speculative_config={}).speculative_config.method == "ngram"


def test_the_timeline_marks_each_steps_proposed_accepted_and_rejected_tokens(
        noisy_draft, make_engine, run_engine):
    from kvscope.ui.timeline import SPEC_MARK_COLORS, request_timeline

    run = run_engine(make_engine("llama", block_size=4,
                                 speculative_config=draft_config(noisy_draft)),
                     PROMPTS[:2], GREEDY)
    marks = {t["name"]: t for t in request_timeline(run.records)["data"]}["speculation"]
    drafts = [d for r in run.records for d in r.spec_drafts]
    assert len(marks["y"]) == len(drafts)
    assert marks["y"] == [seq_id for seq_id, _, _ in drafts]
    proposed, accepted = drafted(run)
    labels = marks["customdata"]
    assert sum(int(label.split(": ")[1].split(" proposed")[0]) for label in labels) == proposed
    assert sum(int(label.split(", ")[1].split(" accepted")[0]) for label in labels) == accepted
    assert set(marks["marker"]["color"]) == set(SPEC_MARK_COLORS.values())  # all, some, none
    without = request_timeline(run_engine(make_engine("llama", block_size=4), PROMPTS[:2],
                                          GREEDY).records)
    assert "speculation" not in [t["name"] for t in without["data"]]


def test_a_reconfigured_engine_keeps_the_target_and_loads_its_draft_afresh(
        small_draft, copy_draft, make_engine, run_engine):
    """A reconfigure hands the new core the old one's executor (engine.orchestrator)."""
    first = make_engine("llama", block_size=4, speculative_config=draft_config(small_draft))
    target = first.runner.target
    config = first.config.with_changes(speculative_config=draft_config(copy_draft))
    second = EngineCore(config, runner=first.runner)
    assert second.runner.target is target
    assert second.runner.proposer.runner.model_path == copy_draft
    proposed, accepted = drafted(run_engine(second, PROMPTS[:2], GREEDY))
    assert proposed > 0 and accepted == proposed
    third = EngineCore(config.with_changes(speculative_config=None), runner=second.runner)
    assert third.runner is target


def test_in_bfloat16_a_copy_of_the_target_has_every_proposal_accepted(tiny_model, run_engine):
    """One bf16 stream on the C++ decoder stack: the draft's one-token forwards compute
    bit for bit what the target's verification rows do, so greedy output is equal to
    speculation off and a copy of the target as the draft is never rejected."""
    path = tiny_model("llama").path
    config = EngineConfig(model=str(path), dtype="bfloat16", device="cpu",
                          device_memory_gb=0.05, block_size=16)
    runner = ModelRunner(config)
    for prompt in SHORT_PROMPTS[2:4]:
        off = run_engine(EngineCore(config, runner=runner), [prompt], GREEDY)
        on = run_engine(EngineCore(config.with_changes(
            speculative_config=draft_config(path, k=4)), runner=runner), [prompt], GREEDY)
        assert token_ids(on) == token_ids(off)
        proposed, accepted = drafted(on)
        assert proposed > 0 and accepted == proposed


def test_a_draft_reading_what_the_targets_window_frees_is_refused(small_draft, tiny_model):
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*the draft's KV cache "
                                         r"groups \(windows \[None\]\) do not fit the "
                                         r"target's \(\[8\]\)"):
        EngineCore(EngineConfig(model=str(tiny_model("mistral-window").path), dtype="float32",
                                device="cpu", device_memory_gb=0.05,
                                speculative_config=draft_config(small_draft)))


def test_structured_output_masks_apply_to_a_drafts_proposals(tiny_byte_level_model_path,
                                                             run_engine):
    """The draft (here the target itself) knows no grammar: a proposal the mask forbids
    has probability 0 and is rejected (on this random model, about every one), and the
    grammar advances only over tokens kept."""
    from kvscope.engine.sampling_params import StructuredOutputsParams

    def engine(**knobs):
        return EngineCore(EngineConfig(model=str(tiny_byte_level_model_path), dtype="float32",
                                       device="cpu", device_memory_gb=0.05, max_model_len=256,
                                       **knobs))

    prompts = ["codes: ab-123, ab-123, ab-124, ab-1", "ab-123, ab-12"]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=(
        StructuredOutputsParams(regex=r"(ab-\d{3}, ){2,4}")))
    off = run_engine(engine(), prompts, params)
    on = run_engine(engine(speculative_config=draft_config(tiny_byte_level_model_path)),
                    prompts, params)

    assert [c.text for o in on.outputs for c in o.outputs] == \
        [c.text for o in off.outputs for c in o.outputs]
    assert token_ids(on) == token_ids(off)
    assert drafted(on)[0] > 0


@pytest.mark.parametrize("arch", ["qwen2-window", "gemma3"])
def test_a_draft_is_paged_by_each_kv_cache_group(arch, tiny_model, make_engine, run_engine):
    """A hybrid target (full and sliding-window groups, each with its own block table):
    the target as its own draft reads each group's table as the target does, through
    windows freeing blocks and preemption, and every proposal holds."""
    knobs = {"block_size": 4, "max_model_len": 72, "max_num_batched_tokens": 16}
    off = run_engine(make_engine(arch, **knobs), SHORT_PROMPTS, MIXED)
    engine = make_engine(arch, **knobs, num_gpu_blocks_override=60,
                         speculative_config=draft_config(tiny_model(arch).path))
    on = run_engine(engine, SHORT_PROMPTS, MIXED)

    assert token_ids(on) == token_ids(off)
    assert engine.scheduler.num_preemptions >= 1
    proposed, accepted = drafted(on)
    assert proposed > 0 and accepted == proposed
    assert engine.kv_cache.pool.num_used_blocks == 0
