"""Speculative decoding seen from outside: /metrics counters (vLLM's names), the per-step
proposals on /ws/events, and bad speculative configs refused at start."""

import json
import re

import httpx
import openai
import pytest
from conftest import serve
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect as ws_connect

from kvscope import app
from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.serving import create_app

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_by_batch_size": None, "min_acceptance_rate": 0.0,
        "adaptive_k": False}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def server(request, tiny_llama_path):
    """A served engine speculating by prompt lookup, or with a draft model (the target's
    own weights loaded again: its proposals are all accepted)."""
    spec = SPEC if request.param == "ngram" else {
        **SPEC, "method": "draft_model", "model": str(tiny_llama_path)}
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=256, speculative_config=spec)).start()
    url, uvicorn_server, thread = serve(create_app(engine))
    yield url, engine.model_path.rsplit("/", 1)[-1]
    uvicorn_server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def spec_metrics(url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if "spec_decode" in sample.name:
                position = sample.labels.get("position")
                samples[sample.name + (f"[{position}]" if position else "")] = sample.value
    return samples


def test_metrics_and_the_event_feed_count_the_same_proposals(server):
    url, model = server
    with ws_connect(url.replace("http", "ws") + "/ws/events") as websocket:
        assert json.loads(websocket.recv(timeout=10))["type"] == "pool_base"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        response = client.completions.create(
            model=model, prompt="abcabcabc abcabc abc", max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True})
        request_id = response.id.removeprefix("cmpl-")
        drafts, finished = [], False
        while not finished:
            message = json.loads(websocket.recv(timeout=10))
            if message["type"] == "steps":
                for record in message["records"]:
                    drafts += record["spec_drafts"]
                    finished |= request_id in record["finished"]

    metrics = spec_metrics(url)
    proposed = sum(d["num_draft_tokens"] for d in drafts)
    accepted = sum(d["num_accepted_tokens"] for d in drafts)
    assert proposed > 0
    assert metrics["vllm:spec_decode_num_drafts_total"] == len(drafts)
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == proposed
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    per_pos = [v for k, v in sorted(metrics.items()) if "per_pos" in k]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert response.usage.completion_tokens == 40


@pytest.mark.parametrize(("flag", "message"), [
    ('{"method": "eagle"}', "speculative_config.method='eagle' must be one of"),
    ('{"num_speculative_tokens": 40}', "num_speculative_tokens=40 must be an integer between"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min=5 must be <= prompt_lookup_max=3"),
    ('{"method": "draft_model"}', "method='draft_model' needs the path or name of a draft"),
    ('{"method": "ngram", "model": "small"}', "model='small': method='ngram' takes no model"),
    ('{"k": 3}', "unknown field(s) ['k']"),
    ('{"adaptive_k": "yes"}', "speculative_config.adaptive_k='yes' must be true or false"),
    ('{"min_acceptance_rate": 1.5}', "speculative_config.min_acceptance_rate=1.5 must be in [0, 1]"),
])
def test_bad_speculative_configs_are_refused_at_start_by_name(flag, message):
    args = app.build_parser().parse_args(["--speculative-config", flag])
    with pytest.raises(ValueError, match=re.escape(message)):
        app.engine_config(args)


def test_the_flag_must_be_a_json_object():
    with pytest.raises(SystemExit):
        app.build_parser().parse_args(["--speculative-config", "ngram"])
