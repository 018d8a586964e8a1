"""Each response's KV cost, through the real openai client on every route: OpenAI's
usage.prompt_tokens_details.cached_tokens equals the prefix-cache tokens the engine reused
(its counter's delta), and kvscope's `kv` object adds up."""

import openai
import pytest
from test_serving import LiveServer, api_served, assert_idle

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine

BLOCK_SIZE = 8
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server(tiny_byte_level_model_path) -> LiveServer:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_byte_level_model_path), dtype="float32", device="cpu",
        block_size=BLOCK_SIZE, num_gpu_blocks_override=128, max_model_len=256)).start()
    with api_served(engine) as server:
        yield server
    engine.shutdown()


def ask(client: openai.OpenAI, model: str, route: str, text: str, stream: bool) -> dict:
    """The response body (streaming: the final usage chunk) as a dict."""
    options = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
               "extra_body": {"ignore_eos": True}}
    if stream:
        options["stream_options"] = {"include_usage": True}
    if route == "chat":
        answer = client.chat.completions.create(
            messages=[{"role": "user", "content": text}], **options)
    else:
        answer = client.completions.create(prompt=text, **options)
    return list(answer)[-1].to_dict() if stream else answer.to_dict()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_cached_tokens_are_the_blocks_reused_and_kv_adds_up(server, route, stream):
    client = server.client()
    text = f"{route} {stream}: a prompt long enough to fill several blocks of eight tokens"
    hits = server.engine.counters().prefix_cache_hits
    first = ask(client, server.model, route, text, stream)
    after_first = server.engine.counters().prefix_cache_hits
    second = ask(client, server.model, route, text, stream)
    reused = server.engine.counters().prefix_cache_hits - after_first

    prompt_tokens = second["usage"]["prompt_tokens"]
    # The first may share a block or two with earlier prompts (a chat template's opening).
    first_cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first_cached == after_first - hits
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block but the one holding the last prompt token (it must be computed).
    assert cached == reused == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > first_cached
    for body, from_cache in ((first, first_cached), (second, cached)):
        kv = body["kv"]
        stored = prompt_tokens + MAX_TOKENS - 1  # the last token sampled is never computed
        assert kv["prefix_cached_tokens"] == from_cache
        assert kv["computed_tokens"] == stored - from_cache
        assert kv["blocks_peak"] == -(-stored // BLOCK_SIZE)
        assert kv["block_seconds"] > 0 and kv["tokens_recomputed"] == 0
    assert_idle(server)
