"""The offline API: LLM(...).generate / .chat take vLLM's inputs and return vLLM-shaped outputs."""

import pytest

from kvscope import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    # The knobs of vLLM's docs example, plus the CPU pool size; vLLM-only knobs are accepted.
    return LLM(model=str(tiny_model("llama").path), block_size=16, gpu_memory_utilization=0.9,
               max_model_len=128, dtype="float32", device="cpu", device_memory_gb=0.05,
               max_num_batched_tokens=256, trust_remote_code=True, enforce_eager=True)


def test_a_single_string_gives_one_output(llm):
    outputs = llm.generate("<5> <6> <7>", GREEDY, use_tqdm=False)
    assert len(outputs) == 1
    output = outputs[0]
    assert isinstance(output, RequestOutput)
    assert output.prompt == "<5> <6> <7>"
    assert output.prompt_token_ids == [5, 6, 7]


def test_strings_and_token_ids_give_the_same_completion(llm):
    from_text = llm.generate(["<5> <6> <7>"], GREEDY, use_tqdm=False)[0]
    from_ids = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0]
    from_dict = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert from_ids.prompt is None
    assert from_ids.prompt_token_ids == [5, 6, 7]
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert from_dict.outputs[0].token_ids == from_ids.outputs[0].token_ids


def test_outputs_come_back_in_input_order_whatever_order_they_finish_in(llm):
    prompts = [[1, 2, 3], "<9> <8>", list(range(10, 60)), [4]]
    max_tokens = [9, 1, 4, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [[1, 2, 3], [9, 8], list(range(10, 60)), [4]]
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert len({o.request_id for o in outputs}) == 4


def test_a_list_of_token_id_lists_is_a_batch(llm):
    outputs = llm.generate([[1, 2], [3, 4, 5]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [[1, 2], [3, 4, 5]]


def test_one_params_per_prompt_must_match_in_number(llm):
    with pytest.raises(ValueError, match=r"sampling_params: 2 given for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_default_sampling_params_give_16_tokens(llm):
    output = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 16


def test_request_output_fields(llm):
    output = llm.generate("<5> <6> <7>", GREEDY, use_tqdm=False)[0]
    assert isinstance(output.request_id, str) and output.request_id
    assert output.finished is True
    assert isinstance(output.num_cached_tokens, int)
    (completion,) = output.outputs
    assert isinstance(completion, CompletionOutput)
    assert completion.index == 0
    assert len(completion.token_ids) == 5
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    assert completion.finish_reason == "length"
    metrics = output.metrics
    assert (metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
            <= metrics.finished_time)
    assert metrics.time_to_first_token == metrics.first_token_time - metrics.arrival_time


def test_a_repeated_prompt_reports_its_cached_tokens(llm):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be reused
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_chat_applies_the_chat_template(tiny_chat_model_path):
    llm = LLM(str(tiny_chat_model_path), dtype="float32", device="cpu", device_memory_gb=0.05,
              max_model_len=256, max_num_batched_tokens=256)
    messages = [{"role": "user", "content": "hi"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert output.prompt == rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    # The template already holds the special tokens: no second BOS in front.
    assert output.prompt_token_ids == tokenizer(rendered, add_special_tokens=False).input_ids

    two = llm.chat([messages, [{"role": "user", "content": "yo"}]],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in two] == [
        rendered, tokenizer.apply_chat_template([{"role": "user", "content": "yo"}],
                                                tokenize=False, add_generation_prompt=True)]
