"""`cache_salt` at the edges: the OpenAI body (through the real openai client) and
LLM.generate's {"prompt": ..., "cache_salt": ...}: prompts share prefix-cache blocks only
under one salt, and a bad salt is a 400 naming the field."""

import openai
import pytest
from test_serving import LiveServer, api_served, assert_idle

from kvscope import LLM, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine

PROMPT = "A prompt long enough for a few full blocks of eight tokens"


@pytest.fixture(scope="module")
def server(tiny_byte_level_model_path) -> LiveServer:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_byte_level_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=128)).start()
    with api_served(engine) as server:
        yield server
    engine.shutdown()


def create(server: LiveServer, route: str, cache_salt, stream: bool = False):
    client, extra = server.client(), {"cache_salt": cache_salt}
    if route == "completions":
        return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                         temperature=0, stream=stream, extra_body=extra)
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
        temperature=0, stream=stream, extra_body=extra)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_only_one_salts_requests_share_a_prefix(server, route):
    first = create(server, route, f"{route}-a")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = create(server, route, f"{route}-a")
    assert again.usage.prompt_tokens_details.cached_tokens >= 2 * 8
    assert create(server, route, f"{route}-b").usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0] == first.choices[0]
    chunks = list(create(server, route, f"{route}-a", stream=True))
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason == "length"
    assert_idle(server)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_salts_are_400s_naming_the_field(server, route):
    for value in (3, "", ["a"], {"a": 1}, True):
        with pytest.raises(openai.BadRequestError) as error:
            create(server, route, value)
        assert error.value.body["param"] == "cache_salt", (value, error.value.body)
        assert "cache_salt" in error.value.body["message"]
    assert_idle(server)


def test_llm_generate_takes_a_salt_per_prompt(tiny_model):
    llm = LLM(str(tiny_model("llama").path), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(10, 23))  # three full blocks, one token past them

    def cached(*prompts) -> list[int]:
        return [o.num_cached_tokens for o in llm.generate(list(prompts), params, use_tqdm=False)]

    assert cached({"prompt_token_ids": prompt, "cache_salt": "a"}) == [0]
    assert cached({"prompt_token_ids": prompt, "cache_salt": "a"},
                  {"prompt_token_ids": prompt, "cache_salt": "b"}, prompt) == [12, 0, 0]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 7}, params, use_tqdm=False)
