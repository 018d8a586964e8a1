"""Sampling: parameter validation, stop conditions, seeds, top-k/top-p, detokenization."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    MinPLogitsWarper,
    PreTrainedTokenizerFast,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvscope import LLM, SamplingParams
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.orchestrator.detokenizer import detokenize_incrementally
from kvscope.engine.sample.sampler import sample

PROMPT = [17, 3, 99, 4, 250, 8, 61]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0}, r"top_p=0 must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"top_p": -0.1}, "top_p=-0.1"),
    ({"top_k": -2}, "top_k=-2"),
    ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
    ({"max_tokens": -3}, "max_tokens=-3"),
    ({"max_tokens": 2.5}, "max_tokens=2.5"),
    ({"n": 0}, "n=0 must be an integer >= 1"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"seed": "7"}, "seed='7'"),
    ({"seed": 2**64}, r"seed=18446744073709551616 must be an integer in \[-2\*\*63"),  # fuzz
    ({"seed": -2**63 - 1}, "seed=-9223372036854775809"),
    ({"stop": ""}, "stop=''"),
    ({"stop": ["ok", ""]}, "stop="),
])
def test_bad_sampling_params_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 16)
    assert params.stop_strings == () and params.stop_token_ids == []
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(top_k=-1).top_k == -1  # vLLM's "no cap"


# ---- the draws ------------------------------------------------------------------------------
DRAW_CASES = {  # every path of the sampler: argmax, whole-vocabulary draws, min-p candidates
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.7),
    "min_p": SamplingParams(temperature=1.3, min_p=0.1),
    "min_p+top_k": SamplingParams(min_p=0.2, top_k=5),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8),
}
DRAWS = 4000


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in the sampler's order: temperature, min-p, top-k, top-p."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[0]).float()
    scores = logits[None] / params.temperature
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


def test_draws_follow_transformers_distributions_in_a_mixed_batch():
    """Each kind of row, DRAWS times over in one interleaved batch: its token frequencies
    are within 4.5 standard errors of transformers' filtered probabilities, and a token
    they drop is never drawn."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 2
    params = list(DRAW_CASES.values()) * DRAWS
    result = sample(logits.expand(len(params), -1).contiguous(), params, [None] * len(params),
                    torch.Generator().manual_seed(0))
    tokens = torch.tensor(result.token_ids).view(DRAWS, len(DRAW_CASES))
    for column, (name, case) in enumerate(DRAW_CASES.items()):
        frequencies = torch.bincount(tokens[:, column], minlength=12) / DRAWS
        expected = reference_probs(logits, case)
        assert (frequencies[expected == 0] == 0).all(), name
        tolerance = 4.5 * (expected * (1 - expected) / DRAWS).sqrt() + 1e-3
        assert ((frequencies - expected).abs() <= tolerance).all(), (name, frequencies, expected)


# ---- the engine's sampling and stopping --------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama").path), dtype="float32", device="cpu",
               device_memory_gb=0.05, max_model_len=64, max_num_batched_tokens=256)


def generate_one(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def greedy_reference(llm):
    return generate_one(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


def test_greedy_text_is_the_decoded_tokens(llm, greedy_reference):
    assert greedy_reference.text == llm.get_tokenizer().decode(greedy_reference.token_ids)
    assert greedy_reference.finish_reason == "length"


def _stop_case(llm, reference, stop: str):
    """Expected (tokens, text) when `stop` ends generation: tokens up to the one that completes
    the first occurrence of `stop`, text cut just before it."""
    decode = llm.get_tokenizer().decode
    for count in range(1, len(reference.token_ids) + 1):
        text = decode(reference.token_ids[:count])
        if stop in text:
            return reference.token_ids[:count], text[:text.index(stop)]
    raise AssertionError(f"{stop!r} is not in the reference output")


@pytest.mark.parametrize("span", [(3, 4), (4, 6)])  # one token's text, and two tokens' text
def test_stop_string_ends_generation_and_is_not_in_the_text(llm, greedy_reference, span):
    decode = llm.get_tokenizer().decode
    stop = decode(greedy_reference.token_ids[span[0]:span[1]])
    tokens, text = _stop_case(llm, greedy_reference, stop)

    output = generate_one(llm, SamplingParams(temperature=0, max_tokens=12, stop=stop))
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop
    assert output.text == text
    assert stop not in output.text
    assert output.token_ids == tokens


def test_the_earliest_of_several_stop_strings_wins(llm, greedy_reference):
    decode = llm.get_tokenizer().decode
    early = decode(greedy_reference.token_ids[2:3])
    late = decode(greedy_reference.token_ids[8:9])
    tokens, text = _stop_case(llm, greedy_reference, early)
    output = generate_one(llm, SamplingParams(temperature=0, max_tokens=12, stop=[late, early]))
    assert (output.stop_reason, output.text, output.token_ids) == (early, text, tokens)


def test_stop_token_id_ends_generation(llm, greedy_reference):
    stop_token = greedy_reference.token_ids[5]
    cut = greedy_reference.token_ids.index(stop_token) + 1
    output = generate_one(llm, SamplingParams(temperature=0, max_tokens=12,
                                              stop_token_ids=[stop_token]))
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop_token
    assert output.token_ids == greedy_reference.token_ids[:cut]


def test_eos_ends_generation_unless_ignored(llm, greedy_reference, monkeypatch):
    eos = greedy_reference.token_ids[4]
    cut = greedy_reference.token_ids.index(eos) + 1
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})
    stopped = generate_one(llm, SamplingParams(temperature=0, max_tokens=12))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy_reference.token_ids[:cut]
    ignored = generate_one(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert ignored.token_ids == greedy_reference.token_ids


@pytest.mark.parametrize("max_tokens", [1, 5, 16])
def test_max_tokens_ends_with_length(llm, max_tokens):
    output = generate_one(llm, SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=3))
    assert output.finish_reason == "length"
    assert len(output.token_ids) == max_tokens


def test_unlimited_max_tokens_stops_at_max_model_len(llm):
    output = generate_one(llm, SamplingParams(temperature=0, max_tokens=None))
    assert output.finish_reason == "length"
    assert len(PROMPT) + len(output.token_ids) == 64


def test_same_seed_same_output_and_different_seeds_differ(llm):
    def sample(seed):
        return generate_one(llm, SamplingParams(temperature=1.0, max_tokens=16, seed=seed))

    first, again, other = sample(7), sample(7), sample(8)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_seeded_request_does_not_depend_on_its_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=11)
    alone = generate_one(llm, params)
    crowd = [[5, 6, 7], list(range(1, 40)), [200] * 9]
    batch = llm.generate([*crowd, PROMPT], [SamplingParams(temperature=1.0, max_tokens=20)] * 3
                         + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.token_ids


def test_n_samples_with_seed_s_equal_single_requests_seeded_s_plus_i(llm):
    output = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=21),
                          use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    for i, completion in enumerate(output.outputs):
        single = generate_one(llm, SamplingParams(temperature=1.0, max_tokens=10, seed=21 + i))
        assert completion.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert llm.engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=1),
    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, ignore_eos=True, seed=2),
    SamplingParams(temperature=0.8, top_k=1, top_p=0.5, max_tokens=12, ignore_eos=True),
], ids=["top_k=1", "tiny top_p", "both"])
def test_a_single_candidate_equals_greedy(llm, greedy_reference, params):
    assert generate_one(llm, params).token_ids == greedy_reference.token_ids


def test_top_k_only_draws_from_the_k_most_likely_tokens(llm, tiny_model):
    """Every sampled token is among the model's top-3 next tokens at its position."""
    output = generate_one(llm, SamplingParams(temperature=5.0, top_k=3, max_tokens=10, seed=5))
    hf_model = tiny_model("llama").hf_model
    sequence = PROMPT + output.token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([sequence])).logits[0]
    for offset, token in enumerate(output.token_ids):
        top3 = logits[len(PROMPT) - 1 + offset].topk(3).indices.tolist()
        assert token in top3


def test_logprobs_hold_the_chosen_token_and_sum_to_the_cumulative(llm):
    output = generate_one(llm, SamplingParams(temperature=1.0, max_tokens=6, seed=4, logprobs=2))
    assert len(output.logprobs) == 6
    assert all(token in step for token, step in zip(output.token_ids, output.logprobs))
    chosen = sum(step[token] for token, step in zip(output.token_ids, output.logprobs))
    assert output.cumulative_logprob == pytest.approx(chosen, abs=1e-4)


# ---- incremental detokenization ----------------------------------------------------------
TEXT = "Paris café 👋🏽 世界 — 日本語のテキスト 🇫🇷 ñandú 😀😀 ∑x² end"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on ASCII: every emoji and CJK character is split
    into several byte tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["Paris is the capital of France, and the end."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core)


def smollm2_tokenizer():
    from kvscope.engine.worker.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("make_tokenizer", [
    byte_level_tokenizer,
    pytest.param(smollm2_tokenizer, marks=pytest.mark.slow),
], ids=["byte-level-bpe", "smollm2"])
def test_incremental_detokenization_never_splits_a_character(make_tokenizer):
    tokenizer = make_tokenizer()
    token_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    final = tokenizer.decode(token_ids)
    assert final == TEXT

    request = Request("detok", None, [], SamplingParams())
    seq = Sequence("detok", request, 0, [], 0)
    held_back = 0
    for token in token_ids:
        seq.token_ids.append(token)
        added = detokenize_incrementally(tokenizer, seq)
        held_back += added == ""
        assert "\ufffd" not in seq.text
        assert final.startswith(seq.text)
    assert seq.text == final
    assert held_back > 0  # some characters really did span several tokens
