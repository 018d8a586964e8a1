"""Chunked prefill under a token budget: parity, step records that add up, and no starvation."""

import itertools
import random
from collections import defaultdict

import pytest
import torch
from conftest import transformers_greedy
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.model_runner import ModelRunner

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_rng = random.Random(21)
# Shorter than a block, one block, one block and a token, several blocks (block size 16).
PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (5, 16, 17, 40, 33)]


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    return transformers_greedy(tiny_model("llama").hf_model, PROMPTS, MAX_TOKENS)


def chunks_by_sequence(records) -> dict[str, list[tuple[int, int, int, str]]]:
    """(step, start, end, kind) of every scheduled piece, per sequence, in step order."""
    chunks = defaultdict(list)
    for record in records:
        for _, seq_id, kind, start, end in record.chunks:
            chunks[seq_id].append((record.step, start, end, kind))
    return chunks


def assert_records_add_up(records, budget: int, prompt_lengths: dict[str, int],
                          num_outputs: int) -> None:
    """Per step: scheduled tokens are the chunks' sum and within the budget. Per sequence:
    its chunks are contiguous from 0, the prefill chunks cover the prompt exactly once,
    and then one decode token per step up to the last generated token."""
    for record in records:
        assert record.token_budget == budget
        assert record.num_scheduled_tokens == sum(end - start for *_, start, end in record.chunks)
        assert record.num_scheduled_tokens <= budget
    for seq_id, chunks in chunks_by_sequence(records).items():
        prompt_length = prompt_lengths[seq_id]
        position = 0
        for _, start, end, kind in chunks:
            assert start == position and end > start
            assert kind == ("prefill" if start < prompt_length else "decode")
            if kind == "decode":
                assert end - start == 1
            position = end
        prefill = [(s, e) for _, s, e, kind in chunks if kind == "prefill"]
        assert sum(e - s for s, e in prefill) == prompt_length
        assert position == prompt_length + num_outputs - 1  # the last token is never fed


@pytest.mark.parametrize(("knobs", "budget"), [
    ({"max_num_batched_tokens": 1}, 1),
    ({"max_num_batched_tokens": 7}, 7),  # chunks end off the block boundaries
    ({"max_num_batched_tokens": 16}, 16),  # chunks end on them
    ({"max_num_batched_tokens": 64}, 64),
    ({"max_num_batched_tokens": 64, "long_prefill_token_threshold": 5}, 64),
    ({"enable_chunked_prefill": False, "max_model_len": 64}, 64),
])
def test_greedy_parity_and_step_records_at_any_budget(knobs, budget, make_engine, run_engine,
                                                     expected):
    engine = make_engine("llama", block_size=16, **knobs)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert [o.outputs[0].token_ids for o in run.outputs] == expected
    lengths = {o.request_id: len(p) for o, p in zip(run.outputs, PROMPTS)}
    assert_records_add_up(run.records, budget, lengths, MAX_TOKENS)
    prefill_chunks = [(request_id, end - start) for r in run.records
                      for request_id, _, kind, start, end in r.chunks if kind == "prefill"]
    if knobs.get("enable_chunked_prefill", True):
        cap = min(budget, knobs.get("long_prefill_token_threshold") or budget)
        assert all(size <= cap for _, size in prefill_chunks)
        assert len(prefill_chunks) > len(PROMPTS)  # some prompt was cut
    else:  # every prompt in one piece
        assert sorted(size for _, size in prefill_chunks) == sorted(map(len, PROMPTS))
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_prefill_chunks_and_decodes_share_a_step(make_engine, run_engine, expected):
    """One forward holds one request's decode and another's prefill chunk (a mixed batch)."""
    engine = make_engine("llama", max_num_batched_tokens=12)
    run = run_engine(engine, PROMPTS, GREEDY)

    mixed = [r for r in run.records
             if {kind for _, _, kind, *_ in r.chunks} == {"prefill", "decode"}]
    assert mixed
    assert [o.outputs[0].token_ids for o in run.outputs] == expected


# ---- a 2,000-token prompt among short ones -------------------------------------------------
LONG, SHORT, NUM_SHORT = 2000, 20, 10


@pytest.fixture(scope="module")
def long_context_runner(tmp_path_factory) -> ModelRunner:
    """A one-layer random Llama with room for 2,048 positions (the others have 256)."""
    folder = tmp_path_factory.mktemp("tiny-long-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2112, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    core = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(256)}, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(folder)
    return ModelRunner(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                    max_model_len=2048))


def first_token_steps(records, prompt_lengths: dict[str, int]) -> dict[str, int]:
    """The step whose prefill chunk ended each request's prompt: its first token's step."""
    return {request_id: record.step for record in records
            for request_id, _, kind, _, end in record.chunks
            if kind == "prefill" and end == prompt_lengths[request_id]}


def run_long_and_short(runner, **knobs):
    """The long prompt and ten short ones arrive together (the long one first); returns
    per request (first-token step, tokens computed up to and including that step) and
    the step where the long prompt's prefill completed."""
    config = EngineConfig(model=runner.model_path, dtype="float32", device="cpu",
                          device_memory_gb=0.5, max_model_len=2048,
                          num_gpu_blocks_override=256, **knobs)
    engine = EngineCore(config, runner=runner)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in [LONG] + [SHORT] * NUM_SHORT]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step().record)
    work_so_far = list(itertools.accumulate(record.num_scheduled_tokens for record in records))
    first_token_step = first_token_steps(records, dict(zip(ids, map(len, prompts))))
    long_done = first_token_step.pop(ids[0])
    return ({rid: (step, work_so_far[step]) for rid, step in first_token_step.items()},
            long_done, records)


def test_short_prompts_overtake_a_long_prefill_with_chunking(long_context_runner):
    budget = 256
    shorts, long_done, records = run_long_and_short(
        long_context_runner, max_num_batched_tokens=budget, long_prefill_token_threshold=128)

    assert len(shorts) == NUM_SHORT
    assert long_done >= LONG // budget  # the long prompt took its many chunks
    for step, work in shorts.values():
        assert step <= 2  # within a few steps of arriving ...
        assert step < long_done  # ... long before the long prompt's prefill is over
        assert work <= 3 * budget
    assert all(r.num_scheduled_tokens <= budget for r in records)


def test_short_prompts_wait_behind_a_long_prefill_without_chunking(long_context_runner):
    shorts, long_done, records = run_long_and_short(
        long_context_runner, enable_chunked_prefill=False)

    assert len(shorts) == NUM_SHORT
    assert records[0].num_scheduled_tokens >= LONG  # the whole prompt in one step
    for step, work in shorts.values():
        assert step >= long_done  # none gets its first token before the long prefill ends
        assert work >= LONG


# ---- long prompts among short chats arriving over time -------------------------------------
# The shape of bench/mixed.py's default traffic, stated here so that the claim is the
# engine's and a change to the bench's defaults cannot move it: a short chat every
# CHAT_INTERVAL steps, and three long prompts spread over the same span, each arriving
# (queued first) with BURST chats.
NUM_CHATS, CHAT_INTERVAL, BURST, MIXED_BUDGET = 32, 2, 4, 512
LONG_ARRIVES_WITH = (0, 10, 21)  # the chat each long prompt arrives with


def mixed_arrivals() -> list[tuple[int, list[int], SamplingParams, bool]]:
    """(arrival step, prompt, params, is a chat) per request, in the order they queue."""
    rng = random.Random(0)
    chat_steps = [index * CHAT_INTERVAL for index in range(NUM_CHATS)]
    for first in LONG_ARRIVES_WITH:
        chat_steps[first:first + BURST] = [chat_steps[first]] * BURST
    chat = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    arrivals = [(chat_steps[first], [rng.randrange(1, 256) for _ in range(LONG)], long, False)
                for first in LONG_ARRIVES_WITH]
    arrivals += [(step, [rng.randrange(1, 256) for _ in range(rng.randint(32, 128))], chat, True)
                 for step in chat_steps]
    return sorted(arrivals, key=lambda arrival: (arrival[0], arrival[3]))


def short_first_token_delays(runner, **knobs) -> list[int]:
    """Steps from arrival to first token of each chat, on the tiny long-context model.
    Requests arrive between steps once the engine has run their arrival step."""
    engine = EngineCore(EngineConfig(
        model=runner.model_path, dtype="float32", device="cpu", max_model_len=2048,
        num_gpu_blocks_override=1024, enable_prefix_caching=False,
        max_num_batched_tokens=MIXED_BUDGET, **knobs), runner=runner)
    pending, arrived, prompt_lengths, records = mixed_arrivals(), {}, {}, []
    steps_run = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():  # idle: skip ahead to the next arrival
            steps_run = max(steps_run, pending[0][0])
        while pending and pending[0][0] <= steps_run:
            _, prompt, params, is_chat = pending.pop(0)
            request_id = engine.add_request(prompt, params).request_id
            prompt_lengths[request_id] = len(prompt)
            if is_chat:
                arrived[request_id] = engine.step_index
        records.append(engine.step().record)
        steps_run += 1
    first_step = first_token_steps(records, prompt_lengths)
    return [first_step[request_id] - step for request_id, step in arrived.items()]


def test_short_requests_get_a_first_token_within_two_steps_by_default(long_context_runner):
    delays = short_first_token_delays(long_context_runner)
    assert max(delays) <= 2, delays
    # Uncapped (long_prefill_token_threshold=0), a running long prefill takes whole steps.
    assert max(short_first_token_delays(long_context_runner,
                                        long_prefill_token_threshold=0)) > 2


# ---- requests and knobs that can never work ------------------------------------------------
@pytest.mark.parametrize(("knobs", "named"), [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0"),
    ({"max_num_batched_tokens": -4}, "max_num_batched_tokens=-4"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128},
     "max_num_batched_tokens=64"),
    ({"swap_space": -0.5}, "swap_space=-0.5"),
    ({"preemption_mode": "bogus"}, "preemption_mode='bogus'"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold=-1"),
])
def test_bad_scheduling_knobs_are_refused_by_name(knobs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        EngineConfig(**knobs)


def test_budget_below_the_models_length_without_chunking_is_refused_at_start(make_engine):
    """max_model_len left to the model (256 positions) still has to fit the budget."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=64.*max_model_len=256"):
        make_engine("llama", enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_a_prompt_that_can_never_run_is_refused_when_added(make_engine, run_engine, expected):
    engine = make_engine("llama", max_model_len=32, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"prompt: 40 tokens.*max_model_len=32"):
        engine.add_request(PROMPTS[3], GREEDY)
    assert not engine.has_unfinished_requests()
    run = run_engine(engine, PROMPTS[:3], GREEDY)  # the others are unaffected
    assert [o.outputs[0].token_ids for o in run.outputs] == expected[:3]
