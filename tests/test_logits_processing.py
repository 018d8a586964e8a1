"""Penalties, min_p, logit_bias, allowed_token_ids, bad_words, min_tokens, prompt logprobs,
truncate_prompt_tokens and best_of against references: transformers' logits processors
where they exist, hand-computed formulas (vLLM's) where they do not, and a dense forward."""

import json

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
)

from kvscope import LLM, SamplingParams
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.sample.logits_processing import LogitsProcessor
from kvscope.engine.sample.sampler import _filtered_probs, min_p_candidates

VOCAB = 256
EOS = 7
PROMPT = [17, 3, 99, 4, 250, 8, 61, 3, 3]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from kvscope.engine.worker.loader import load_tokenizer
    return load_tokenizer(tiny_model("llama").path)


@pytest.fixture
def processor(tokenizer) -> LogitsProcessor:
    return LogitsProcessor(VOCAB, tokenizer, {EOS}, torch.device("cpu"))


def sequence(processor: LogitsProcessor, params: SamplingParams, output: list[int] = (),
             prompt: list[int] = PROMPT) -> Sequence:
    request = Request(f"r{id(params)}", None, list(prompt), params,
                      constraints=processor.prepare(params))
    seq = Sequence(request.request_id, request, 0, list(prompt) + list(output), len(prompt))
    request.sequences.append(seq)
    return seq


def step(processor: LogitsProcessor, seqs: list[Sequence], tokens: list[int]) -> None:
    """What the engine does after sampling: count the tokens, then append them."""
    processor.accept(seqs, tokens)
    for seq, token in zip(seqs, tokens, strict=True):
        seq.token_ids.append(token)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# ---- penalties --------------------------------------------------------------------------
PENALTIES = [  # (repetition, frequency, presence): each alone, all at once, and none
    (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.5), (1.2, 0.4, 0.9),
    (1.0, 0.0, 0.0),
]


def test_penalties_over_a_mixed_batch_match_transformers_and_vllms_formulas(processor):
    seqs = [sequence(processor, SamplingParams(repetition_penalty=r, frequency_penalty=f,
                                               presence_penalty=p)) for r, f, p in PENALTIES]
    generated = [[5, 9, 5], [3, 3, 200], [5, 5, 5], [12, 99, 12], [3, 250, 3], [1, 2, 3]]
    for position in range(3):  # as in the engine: apply, then count the sampled tokens
        processor.apply(random_logits(len(seqs)), seqs)
        step(processor, seqs, [tokens[position] for tokens in generated])
    logits = random_logits(len(seqs))
    processed = processor.apply(logits, seqs)

    for row, seq in enumerate(seqs):
        torch.testing.assert_close(processed[row], reference_penalties(logits[row], seq))
    assert torch.equal(logits, random_logits(len(seqs))), "the raw logits are left alone"


def reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """transformers' repetition penalty, then vLLM's frequency and presence formulas."""
    params = seq.request.params
    ids = torch.tensor([seq.token_ids])
    expected = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits[None])[0]
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long),
                            minlength=VOCAB).float()
    return expected - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def test_penalty_state_grows_with_the_batch_and_the_sequences(processor):
    """Ten sequences (more than the first 8 slots) whose tokens outgrow the first 64
    columns while they sample, some joining late and one with an output it already had:
    every step's penalised logits still match the reference."""
    generator = torch.Generator().manual_seed(5)
    seqs = [sequence(processor, SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3,
                                               presence_penalty=0.2),
                     output=torch.randint(0, VOCAB, (i % 3,), generator=generator).tolist(),
                     prompt=torch.randint(0, VOCAB, (40 + 3 * i,), generator=generator).tolist())
            for i in range(10)]
    for position in range(12):
        batch = seqs[:5] if position < 4 else seqs
        logits = random_logits(len(batch), seed=position)
        processed = processor.apply(logits, batch)
        for row, seq in enumerate(batch):
            torch.testing.assert_close(processed[row], reference_penalties(logits[row], seq))
        step(processor, batch, torch.randint(0, 20, (len(batch),), generator=generator).tolist())
    assert processor.token_ids.shape == (16, 128)


def test_a_batch_without_edits_is_returned_as_is(processor):
    logits = random_logits(2)
    seqs = [sequence(processor, SamplingParams()) for _ in range(2)]
    assert processor.apply(logits, seqs) is logits


def test_finished_sequences_give_their_count_rows_back(processor):
    seqs = [sequence(processor, SamplingParams(frequency_penalty=1.0)) for _ in range(3)]
    processor.apply(random_logits(3), seqs)
    assert len(processor.slots) == 3
    from kvscope.engine.core.request import SequenceStatus
    seqs[1].status = SequenceStatus.FINISHED
    processor.apply(random_logits(2), [seqs[0], seqs[2]])
    assert set(processor.slots) == {seqs[0], seqs[2]} and len(processor.free_slots) >= 1


# ---- logit_bias, allowed_token_ids, bad_words, min_tokens ---------------------------------
def test_logit_bias_matches_transformers_sequence_bias(processor):
    bias = {"5": 4.0, "200": -3.5, "17": 250.0}  # JSON keys; clamped to [-100, 100]
    seqs = [sequence(processor, SamplingParams(logit_bias=bias)),
            sequence(processor, SamplingParams())]
    logits = random_logits(2)
    processed = processor.apply(logits, seqs)
    oracle = SequenceBiasLogitsProcessor({(5,): 4.0, (200,): -3.5, (17,): 100.0})
    expected = oracle(torch.tensor([PROMPT]), logits[:1].clone())[0]
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], logits[1])


def test_allowed_token_ids_leave_only_those_tokens(processor):
    allowed = [4, 66, 130]
    seqs = [sequence(processor, SamplingParams()),
            sequence(processor, SamplingParams(allowed_token_ids=allowed))]
    logits = random_logits(2)
    processed = processor.apply(logits, seqs)
    expected = torch.full((VOCAB,), float("-inf"))
    expected[allowed] = logits[1, allowed]
    torch.testing.assert_close(processed[1], expected)
    torch.testing.assert_close(processed[0], logits[0])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(processor):
    params = SamplingParams(min_tokens=2, stop_token_ids=[40])
    seq = sequence(processor, params)
    for output_length in range(3):
        processed = processor.apply(random_logits(1), [seq])
        masked = processed[0, [EOS, 40]].isinf().tolist()
        assert masked == [output_length < 2] * 2, output_length
        step(processor, [seq], [11])


def test_bad_words_ban_single_tokens_and_the_last_token_after_a_prefix(processor):
    seq = sequence(processor, SamplingParams(bad_words=["<5>", "<9> <12>"]), output=[1])
    processed = processor.apply(random_logits(1), [seq])
    assert processed[0, 5].isinf() and not processed[0, 12].isinf()
    step(processor, [seq], [9])  # the prefix <9> is out: <12> would complete the bad word
    processed = processor.apply(random_logits(1), [seq])
    assert processed[0, 5].isinf() and processed[0, 12].isinf()


@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {"300": 1.0}), ("allowed_token_ids", [1, 256]), ("stop_token_ids", [999])])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(processor, field, value):
    with pytest.raises(ValueError, match=f"^{field}: token id"):
        processor.prepare(SamplingParams(**{field: value}))


# ---- min_p --------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_keeps_the_tokens_transformers_min_p_keeps(min_p, top_k):
    logits = random_logits(3, seed=1)
    probs = _filtered_probs(logits, [SamplingParams(min_p=min_p, temperature=0.8,
                                                    top_k=top_k)] * 3)
    expected = MinPLogitsWarper(min_p)(None, logits / 0.8)
    if top_k:  # vLLM's order: min-p, then top-k
        expected = TopKLogitsWarper(top_k)(None, expected)
    expected = expected.softmax(dim=-1)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_candidates_are_the_tokens_transformers_min_p_keeps(min_p):
    """The sampler's path for rows filtered by min-p alone: the kept tokens, and weights
    proportional to their probabilities."""
    logits = random_logits(3, seed=1)
    logits[2, 40] = logits[2].max()  # a tie with the most likely token: both stay
    rows, tokens, weights = min_p_candidates(logits, [SamplingParams(min_p=min_p,
                                                                     temperature=0.8)] * 3)
    expected = MinPLogitsWarper(min_p)(None, logits / 0.8).softmax(dim=-1)
    probs = torch.zeros_like(expected).index_put_((rows, tokens), weights)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs / probs.sum(dim=1, keepdim=True), expected)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"repetition_penalty": 0}, "repetition_penalty=0 must be > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5 must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, "frequency_penalty=-3"),
    ({"min_p": 1.2}, r"min_p=1.2 must be in \[0, 1\]"),
    ({"min_tokens": -1}, "min_tokens=-1"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens=20 must be <= max_tokens=5"),
    ({"best_of": 1, "n": 2}, "best_of=1 must be >= n=2"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0"),
    ({"logit_bias": {"x": 1}}, "logit_bias="),
    ({"allowed_token_ids": []}, "allowed_token_ids="),
    ({"bad_words": [""]}, "bad_words="),
])
def test_bad_new_params_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---- in the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama").path), dtype="float32", device="cpu",
               device_memory_gb=0.05, max_model_len=96, max_num_batched_tokens=64,
               long_prefill_token_threshold=16)


def hf_next_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


def test_greedy_with_penalties_follows_transformers_step_by_step(llm, tiny_model):
    hf = tiny_model("llama").hf_model
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8,
                            frequency_penalty=0.6, presence_penalty=0.4, logit_bias={5: 2.0})
    plain, penalised = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0, max_tokens=12), params], use_tqdm=False)
    tokens = list(PROMPT)
    for token in penalised.outputs[0].token_ids:
        logits = hf_next_logits(hf, tokens)
        logits[5] += 2.0
        logits = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([tokens]), logits[None])[0]
        counts = torch.bincount(torch.tensor(tokens[len(PROMPT):], dtype=torch.long),
                                minlength=VOCAB).float()
        logits = logits - 0.6 * counts - 0.4 * (counts > 0).float()
        assert token == int(logits.argmax())
        tokens.append(token)
    assert penalised.outputs[0].token_ids != plain.outputs[0].token_ids


def test_min_tokens_holds_back_an_eos_the_model_would_pick(llm, monkeypatch):
    monkeypatch.setattr(llm.engine, "eos_token_ids", {EOS})
    monkeypatch.setattr(llm.engine.logits_processor, "eos_token_ids", [EOS])
    eager = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100})
    output = llm.generate([PROMPT], eager, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == [EOS] and output.finish_reason == "stop"
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=6)
    output = llm.generate([PROMPT], held, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 7 and output.token_ids[-1] == EOS
    assert EOS not in output.token_ids[:6] and output.finish_reason == "stop"


def test_allowed_token_ids_and_min_p_bound_what_is_sampled(llm):
    allowed = [10, 20, 30, 40]
    outputs = llm.generate([PROMPT] * 4, SamplingParams(
        temperature=1.5, max_tokens=10, allowed_token_ids=allowed, min_p=0.05, seed=3),
        use_tqdm=False)
    for output in outputs:
        assert set(output.outputs[0].token_ids) <= set(allowed)


def test_prompt_logprobs_equal_a_dense_forward_across_chunks(llm, tiny_model):
    hf = tiny_model("llama").hf_model
    prompt = [(7 * i + 3) % VOCAB for i in range(50)]  # 50 tokens: four 16-token chunks
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        dense = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    entries, ranks = output.prompt_logprobs, output.prompt_token_ranks
    assert len(entries) == len(ranks) == len(prompt) and entries[0] is None is ranks[0]
    for position in range(1, len(prompt)):
        entry = entries[position]
        token = prompt[position]
        assert entry[token] == pytest.approx(float(dense[position - 1, token]), abs=1e-4)
        top = dense[position - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4
        # vLLM's rank: how many tokens are at least as likely, the token itself included.
        assert ranks[position] == int((dense[position - 1] >= dense[position - 1, token]).sum())


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(llm):
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3,
                                                   truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert output.prompt_token_ids == PROMPT[-4:]
    alone = llm.generate([PROMPT[-4:]], SamplingParams(temperature=0, max_tokens=3),
                         use_tqdm=False)[0]
    assert output.outputs[0].token_ids == alone.outputs[0].token_ids


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(llm):
    every = llm.generate([PROMPT], SamplingParams(n=5, temperature=1.0, max_tokens=6, seed=11),
                         use_tqdm=False)[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6,
                                                 seed=11), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    assert llm.engine.kv_cache.pool.num_used_blocks == 0


def test_generation_config_supplies_the_default_sampling(tiny_model, tmp_path):
    import shutil
    folder = shutil.copytree(tiny_model("llama").path, tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_p": 0.8, "repetition_penalty": 1.1, "max_new_tokens": 7}))
    llm = LLM(str(folder), dtype="float32", device="cpu", device_memory_gb=0.05,
              max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty,
            defaults.max_tokens) == (0.25, 0.8, 1.1, 7)
    output = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 7  # max_new_tokens, not SamplingParams' 16


def test_the_chat_accordion_starts_from_the_models_defaults(tiny_model, tmp_path):
    import shutil

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.async_engine import AsyncEngine
    from kvscope.ui import chat

    folder = shutil.copytree(tiny_model("llama").path, tmp_path / "model")
    knobs = {"dtype": "float32", "device": "cpu", "device_memory_gb": 0.05, "max_model_len": 64}

    def defaults_read_by_the_accordion() -> tuple[dict, str]:
        # An engine that is never started still holds its (idle) thread: shut down.
        engine = AsyncEngine.from_config(EngineConfig(model=str(folder), **knobs))
        try:
            return chat.sampling_defaults(engine)
        finally:
            engine.shutdown()

    values, note = defaults_read_by_the_accordion()
    assert values == chat.CHAT_DEFAULTS and "sets no sampling defaults" in note
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3,
                                                                "repetition_penalty": 1.2}))
    values, note = defaults_read_by_the_accordion()
    assert values["temperature"] == 0.3 and values["repetition_penalty"] == 1.2
    assert values["top_p"] == chat.CHAT_DEFAULTS["top_p"]
    assert "temperature 0.3" in note and "repetition_penalty 1.2" in note


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_and_penalties_survive_preemption(make_engine, run_engine, tiny_model,
                                                          mode):
    """A tight pool and small chunks: sequences are preempted mid-prefill and mid-decode;
    prompt logprobs still equal a dense forward's, entry for entry, and penalised greedy
    outputs equal their uncontended selves."""
    hf = tiny_model("llama").hf_model
    prompts = [[(11 * i + 5 * j) % VOCAB for j in range(30)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1,
                             repetition_penalty=1.5, frequency_penalty=0.5)] * len(prompts)
    alone = run_engine(make_engine("llama", max_model_len=64), prompts, params)
    pressed = make_engine("llama", block_size=8, max_model_len=64, num_gpu_blocks_override=9,
                          swap_space=0.001, preemption_mode=mode, max_num_batched_tokens=16,
                          long_prefill_token_threshold=8)
    run = run_engine(pressed, prompts, params)
    assert sum(o.metrics.num_preemptions for o in run.outputs) >= 2
    for prompt, output, reference in zip(prompts, run.outputs, alone.outputs, strict=True):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        with torch.no_grad():
            dense = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            assert output.prompt_logprobs[position][prompt[position]] == pytest.approx(
                float(dense[position - 1, prompt[position]]), abs=1e-4)
    assert pressed.kv_cache.pool.num_used_blocks == 0
