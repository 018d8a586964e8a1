"""/tokenize and /detokenize in vLLM's shapes, through the openai client, under the key."""

import httpx
import openai
import pytest
from conftest import serve

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.serving import create_app

KEY = "secret"


@pytest.fixture(scope="module")
def served(tiny_chat_model_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=256)).start()
    url, server, thread = serve(create_app(engine, api_key=KEY))
    yield url, engine
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def post(url: str, path: str, body: dict, api_key: str = KEY) -> dict:
    # vLLM serves these beside /v1, at the root; the client's generic post reaches them.
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
    return client.post(path, body=body, cast_to=object)


def test_prompt_round_trip_with_token_strings(served):
    url, engine = served
    tokenized = post(url, "/tokenize", {"prompt": "Hello kv", "return_token_strs": True})
    assert tokenized["tokens"] == engine.tokenizer("Hello kv")["input_ids"]
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 256
    assert tokenized["token_strs"] == engine.tokenizer.convert_ids_to_tokens(tokenized["tokens"])
    plain = post(url, "/tokenize", {"prompt": "Hello kv", "add_special_tokens": False})
    assert plain["token_strs"] is None
    assert plain["tokens"] == engine.tokenizer("Hello kv", add_special_tokens=False)["input_ids"]
    assert post(url, "/detokenize", {"tokens": plain["tokens"]}) == {"prompt": "Hello kv"}


def test_messages_go_through_the_chat_template(served):
    url, engine = served
    messages = [{"role": "user", "content": "hi"}]
    tokenized = post(url, "/tokenize", {"messages": messages})
    prompt = engine.render_chat(messages)
    assert tokenized["tokens"] == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert post(url, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"] == prompt
    without = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without["count"] < tokenized["count"]


def test_refusals(served):
    url, engine = served
    with pytest.raises(openai.AuthenticationError):
        post(url, "/tokenize", {"prompt": "x"}, api_key="wrong")
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 401
    with pytest.raises(openai.BadRequestError) as refused:
        post(url, "/detokenize", {"tokens": [len(engine.tokenizer)]})
    assert refused.value.body["param"] == "tokens"
    with pytest.raises(openai.NotFoundError):
        post(url, "/tokenize", {"model": "other", "prompt": "x"})
    with pytest.raises(openai.BadRequestError):
        post(url, "/tokenize", {"prompt": "x", "messages": []})
