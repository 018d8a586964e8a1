"""Tests for engine.serving against a live server: the openai client, SSE, errors, metrics,
the websocket feed and reconfigure under traffic."""

import asyncio
import contextlib
import json
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from conftest import serve, wait_until
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect as ws_connect

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.serving import create_app
from kvscope.engine.serving.metrics import EngineMetrics
from kvscope.storage import SessionLog, record_sessions

NUM_BLOCKS = 256
MAX_MODEL_LEN = 256
REPO = Path(__file__).resolve().parents[1]
IGNORE_EOS = {"ignore_eos": True}  # the tiny model may sample its EOS at any step


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    model: str

    def client(self, api_key: str = "x") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{label=value,...}` -> value (labels sorted; the model and
        the replica or engine, always 0 for this one engine, left out)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k not in ("model_name", "replica", "engine"))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> AsyncEngine:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512)).start()
    yield engine
    engine.shutdown()


@contextlib.contextmanager
def api_served(engine: AsyncEngine) -> Iterator[LiveServer]:
    """The OpenAI-compatible server on a started engine, on a free loopback port, stopped
    when the block ends (the engine stays the caller's to shut down)."""
    url, uvicorn_server, thread = serve(create_app(engine))
    try:
        yield LiveServer(url, engine, engine.model_path.rsplit("/", 1)[-1])
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(engine) -> LiveServer:
    with api_served(engine) as server:
        yield server



def assert_idle(server: LiveServer) -> None:
    """No request running or waiting, and no block in use (cached-free is fine)."""
    snapshot = server.engine.snapshot()
    assert snapshot.count("used") + snapshot.count("shared") == 0
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running{}"] == 0
    assert metrics["vllm:num_requests_waiting{}"] == 0
    assert metrics["vllm:kv_cache_usage_perc{}"] == 0


# ---- the OpenAI API through the openai client ------------------------------------------
def test_models_health_version(server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["step_failures"] == 0
    assert "version" in httpx.get(f"{server.url}/version").json()


def test_completion_and_chat(server) -> None:
    client = server.client()
    completion = client.completions.create(model=server.model, prompt="Hello there",
                                           max_tokens=5, extra_body=IGNORE_EOS)
    choice = completion.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == len("Hello there")  # one token per character

    chat = client.chat.completions.create(
        model=engine_path(server), max_tokens=4, extra_body=IGNORE_EOS,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi!"}])
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content
    assert chat.usage.completion_tokens == 4


def engine_path(server: LiveServer) -> str:
    """The model's path works as its name too."""
    return server.engine.model_path


def test_streaming_matches_the_whole_response(server) -> None:
    client = server.client()
    kwargs = {"model": server.model, "max_tokens": 8, "seed": 11, "extra_body": IGNORE_EOS}
    whole = client.completions.create(prompt="stream me", **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt="stream me", stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    messages = [{"role": "user", "content": "stream a chat"}]
    whole = client.chat.completions.create(messages=messages, **kwargs).choices[0]
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seed_reproducibility(server) -> None:
    client = server.client()

    def texts(seed, n=2):
        response = client.completions.create(model=server.model, prompt="two ways", n=n,
                                             max_tokens=10, seed=seed, temperature=1.0,
                                             extra_body=IGNORE_EOS)
        assert sorted(c.index for c in response.choices) == list(range(n))
        assert response.usage.completion_tokens == 10 * n
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = texts(seed=1)
    assert first == texts(seed=1)
    assert first[0] != first[1]
    assert texts(seed=2) != first

    streamed = client.completions.create(model=server.model, prompt="two ways", n=2,
                                         max_tokens=10, seed=1, stream=True,
                                         extra_body=IGNORE_EOS)
    pieces = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert [pieces[0], pieces[1]] == first


def test_stop_string_cuts_the_text(server) -> None:
    client = server.client()
    kwargs = {"model": server.model, "prompt": "stop here", "max_tokens": 12,
              "temperature": 0, "extra_body": IGNORE_EOS}
    text = client.completions.create(**kwargs).choices[0].text
    # One token per character: a character first seen at position 3 stops after 3.
    stop = next(ch for i, ch in enumerate(text) if i >= 3 and text.index(ch) == i)
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.text == text[:text.index(stop)]
    assert stopped.finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_repeated_prompt_reports_cached_tokens(server) -> None:
    client = server.client()
    prompt = "A shared system prompt that spans several KV blocks. Question"
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    block_size = server.engine.config.block_size
    assert cached == (len(prompt) - 1) // block_size * block_size > 0


def test_logprobs(server) -> None:
    client = server.client()
    completion = client.completions.create(model=server.model, prompt="logprobs", max_tokens=4,
                                           logprobs=2, extra_body=IGNORE_EOS)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, 1, 2, 3]

    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.logprob for item in content)


# ---- load: many streaming clients, some hanging up --------------------------------------
def test_64_streaming_clients_with_random_disconnects(server) -> None:
    rng = random.Random(0)
    # About a third of the clients hang up after a random number of chunks.
    hang_up_after = [rng.randint(1, 6) if rng.random() < 0.35 else None for _ in range(64)]

    async def client(index: int, http: httpx.AsyncClient) -> str | None:
        body = {"model": server.model, "prompt": f"client {index}", "max_tokens": 12,
                "stream": True, "ignore_eos": True}
        received, finish = 0, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return finish
                chunk = json.loads(line[len("data: "):])
                finish = chunk["choices"][0]["finish_reason"] or finish
                received += 1
                if hang_up_after[index] is not None and received >= hang_up_after[index]:
                    return "hung up"
        return None

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            return await asyncio.gather(*(client(i, http) for i in range(64)))

    results = asyncio.run(run_all())  # (the clients' 60 s timeout only catches a hang)
    for planned, result in zip(hang_up_after, results, strict=True):
        assert result == ("hung up" if planned is not None else "length")
    # Aborts of the hung-up clients land at the next step boundary.
    wait_until(lambda: server.engine.snapshot().count("used") == 0)
    assert_idle(server)


# ---- bad input ------------------------------------------------------------------------
BAD_REQUESTS = [
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "suffix": "!"}, 400, "suffix"),  # echo is implemented
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("completions", {"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [MAX_MODEL_LEN * 4]}, 400, "prompt"),  # token id >= vocab
    ("completions", {"temperature": 1}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
]


def test_bad_requests_get_their_status_and_name_the_parameter(server) -> None:
    with httpx.Client(base_url=f"{server.url}/v1") as http:
        for path, body, status, param in BAD_REQUESTS:
            response = http.post(f"/{path}", json={"model": server.model, **body})
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["message"] and error["type"]

        too_long = http.post("/completions", json={"prompt": "y" * 300, "max_tokens": 2})
        assert too_long.status_code == 400
        message = too_long.json()["error"]["message"]
        assert "300" in message and str(MAX_MODEL_LEN) in message

        not_json = http.post("/completions", content=b"{nope",
                             headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and "error" in not_json.json()

        too_long_chat = http.post("/chat/completions", json={
            "messages": [{"role": "user", "content": "y" * 300}]})
        assert too_long_chat.status_code == 400
        assert too_long_chat.json()["error"]["param"] == "messages"
        # Found by the fuzzer: the message said "prompt: ...", a field the chat route lacks.
        assert too_long_chat.json()["error"]["message"].startswith(
            "messages (as the rendered prompt): ")

        huge = http.post("/completions", json={"prompt": "z" * (1 << 20)})
        assert huge.status_code == 413 and huge.json()["error"]["message"]
        chunked = http.post("/completions", content=iter([b" " * (1 << 19)] * 3),
                            headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and chunked.json()["error"]["message"]

    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model=server.model, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    # The engine still answers good requests after the burst.
    assert server.client().completions.create(model=server.model, prompt="ok",
                                              max_tokens=2).choices[0].text is not None
    assert_idle(server)


# ---- metrics ----------------------------------------------------------------------------
def test_metrics_parse_and_counters_match_the_requests(server) -> None:
    before = server.metrics()
    client = server.client()
    usages = [client.completions.create(model=server.model, prompt=f"count me {i}",
                                        max_tokens=3 + i, extra_body=IGNORE_EOS).usage
              for i in range(3)]
    after = server.metrics()

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("vllm:prompt_tokens_total{}") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total{}") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total{finished_reason=length}") == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
        assert delta(f"vllm:{histogram}_count{{}}") == 3
    assert delta("vllm:inter_token_latency_seconds_count{}") == sum(
        u.completion_tokens - 1 for u in usages)
    # Each prompt is looked up once (nothing preempts in this pool, so nothing recomputes):
    assert delta("vllm:prefix_cache_queries_total{}") == sum(u.prompt_tokens for u in usages)
    for reason in ("kv_full", "priority", "max_num_seqs"):
        assert delta(f"vllm:num_preemptions_total{{reason={reason}}}") == 0
    assert sum(value for name, value in after.items()
               if name.startswith("vllm:num_preemptions_total")) == \
        server.engine.counters().preemptions
    assert after["kvscope:swaps_total{direction=out}"] == 0
    assert after["kvscope:kv_cache_token_usage_perc{}"] == 0
    info = next(name for name in after if name.startswith("kvscope:engine_config_info"))
    assert "block_size=8" in info and f"num_blocks={NUM_BLOCKS}" in info
    assert_idle(server)


def test_metrics_observe_each_finished_request_without_a_scrape(engine) -> None:
    """Found by the soak: the finished requests (outputs and all) waited in /metrics' feed
    for a scrape, up to 10,000 of them, and past that were lost to the histograms."""
    app = create_app(engine)
    url, uvicorn_server, thread = serve(app)
    metrics: EngineMetrics = app.state.metrics
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

    def observed() -> float:
        histogram = metrics.histograms["vllm:e2e_request_latency_seconds"]
        return sum(sample.value for family in histogram.collect()
                   for sample in family.samples if sample.name.endswith("_count"))

    try:
        for i in range(3):
            client.completions.create(model=engine.model_path.rsplit("/", 1)[-1],
                                     prompt=f"seen {i}", max_tokens=2)
        wait_until(lambda: observed() == 3, timeout=10, what="3 requests observed")
        assert not metrics.finished_requests.drain()  # nothing left queued for a scrape
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=10)
    assert metrics.finished_requests.closed  # the stopped app no longer subscribes


# ---- the websocket event feed -----------------------------------------------------------
class ClientPool:
    """What a websocket client keeps from the pool messages: ref counts and hashes."""

    def __init__(self) -> None:
        self.refs: list[int] = []
        self.hashes: dict[int, list] = {}
        self.covered = 0
        self.next_index = None

    def apply(self, message: dict) -> None:
        if message["type"] == "pool_base":
            self.refs = [0] * message["counters"]["num_blocks"]
            self.hashes, self.covered, self.next_index = {}, 0, message["index"]
        elif message["type"] == "pool_slice":
            start, refs = message["start"], message["ref_counts"]
            self.refs[start:start + len(refs)] = refs
            for block_id in range(start, start + len(refs)):
                self.hashes.pop(block_id, None)
            self.hashes.update((block_id, h) for block_id, h in message["hashes"])
            self.covered = start + len(refs)
        elif message["type"] == "pool":
            for delta in message["deltas"]:
                if delta["index"] < self.next_index:
                    continue  # already in the snapshot
                assert delta["index"] == self.next_index
                self.next_index += 1
                for block_id, ref_count, block_hash in delta["blocks"]:
                    self.refs[block_id] = ref_count
                    if block_hash is None:
                        self.hashes.pop(block_id, None)
                    else:
                        self.hashes[block_id] = block_hash

    def counts(self) -> dict[str, int]:
        states = ["shared" if ref > 1 else "used" if ref == 1 else
                  "cached" if block_id in self.hashes else "free"
                  for block_id, ref in enumerate(self.refs)]
        return {state: states.count(state) for state in ("free", "cached", "used", "shared")}


def test_websocket_sends_pool_deltas_and_coalesced_step_records(server) -> None:
    with ws_connect(server.url.replace("http", "ws") + "/ws/events") as websocket:
        first = json.loads(websocket.recv(timeout=10))
        assert first["type"] == "pool_base" and first["counters"]["num_blocks"] == NUM_BLOCKS
        client_pool = ClientPool()
        client_pool.apply(first)
        response = server.client().completions.create(model=server.model, prompt="watch me",
                                                      max_tokens=40, extra_body=IGNORE_EOS)
        request_id = response.id.removeprefix("cmpl-")
        steps, seen_steps, pool_messages = [], [], 0
        while request_id not in {r for m in steps for rec in m["records"]
                                 for r in rec["finished"]}:
            message = json.loads(websocket.recv(timeout=10))
            if message["type"] == "steps":
                steps.append(message)
                seen_steps += [record["step"] for record in message["records"]]
            else:
                client_pool.apply(message)
                pool_messages += message["type"] == "pool"
        ran = [chunk for m in steps for rec in m["records"] for chunk in rec["chunks"]
               if chunk["request_id"] == request_id]
        assert {chunk["kind"] for chunk in ran} == {"prefill", "decode"}
        assert seen_steps == sorted(seen_steps)
        # 40+ steps (a few ms each) arrive in far fewer messages: at most 10 a second.
        assert len(steps) < len(seen_steps) and 0 < pool_messages < len(seen_steps)

        # The client's pool, kept from the deltas alone, is the engine's (once the last
        # coalesced pool message is in: the engine is idle now, nothing more follows).
        try:
            while True:
                message = json.loads(websocket.recv(timeout=1.0))
                if message["type"] != "steps":
                    client_pool.apply(message)
        except TimeoutError:
            pass
        websocket.send(json.dumps({"type": "snapshot"}))
        reply = json.loads(websocket.recv(timeout=10))
        while reply["type"] != "snapshot":
            if reply["type"] != "steps":
                client_pool.apply(reply)
            reply = json.loads(websocket.recv(timeout=10))
        snapshot = reply["snapshot"]
        assert client_pool.covered == NUM_BLOCKS
        assert client_pool.counts() == snapshot["counts"] and snapshot["counts"]["used"] == 0
        assert client_pool.refs == [block["ref_count"] for block in snapshot["blocks"]]
        assert {i: h[0] for i, h in client_pool.hashes.items()} == {
            block["block_id"]: block["block_hash"] for block in snapshot["blocks"]
            if block["block_hash"]}


def test_a_websocket_snapshot_is_the_connections_mirror_not_an_engine_copy(
        server, monkeypatch) -> None:
    """{"type": "snapshot"} is answered from the pool the connection was sent (kept in a
    mirror, built in a worker thread): the engine thread never copies its pool for it."""
    def no_engine_snapshot(*args, **kwargs):
        raise AssertionError("the engine thread was asked for a full snapshot")

    monkeypatch.setattr(server.engine, "snapshot_records", no_engine_snapshot)
    with ws_connect(server.url.replace("http", "ws") + "/ws/events", max_size=None) as websocket:
        websocket.send(json.dumps({"type": "snapshot"}))
        reply = json.loads(websocket.recv(timeout=10))
        while reply["type"] != "snapshot":
            reply = json.loads(websocket.recv(timeout=10))
    snapshot = reply["snapshot"]
    assert snapshot["num_blocks"] == len(snapshot["blocks"]) == NUM_BLOCKS
    assert sum(snapshot["counts"].values()) == NUM_BLOCKS


def test_stalled_websocket_client_does_not_hold_up_generation(server) -> None:
    """Generation runs to the end while a websocket client that never reads keeps the
    buffers between it and the server full (how much it slows steps is for a benchmark,
    not a wall-clock limit here)."""
    client = server.client()
    # This client asks for ~3 MB of snapshots and never reads (max_queue=1: its library
    # stops reading too), so the buffers between it and the server fill up.
    # close_timeout: the server cannot send its close frame past the full buffers.
    with ws_connect(server.url.replace("http", "ws") + "/ws/events", max_size=None,
                    max_queue=1, close_timeout=0.5) as stalled:
        for _ in range(100):
            stalled.send(json.dumps({"type": "snapshot"}))
        finish_reasons = []
        threads = [threading.Thread(target=lambda i=i: finish_reasons.append(
            client.completions.create(model=server.model, prompt=f"timing {i}", max_tokens=30,
                                      extra_body=IGNORE_EOS).choices[0].finish_reason))
            for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)  # only catches a hang
        assert finish_reasons == ["length"] * 4  # while the stalled client is connected
    assert_idle(server)


# ---- reconfigure under traffic ------------------------------------------------------------
def test_reconfigure_during_traffic(server) -> None:
    client, engine = server.client(), server.engine
    texts: dict[int, str] = {}
    first_chunk = threading.Barrier(5)

    def stream(index: int) -> None:
        chunks = client.completions.create(model=server.model, prompt=f"in flight {index}",
                                           max_tokens=200, stream=True, extra_body=IGNORE_EOS)
        pieces = []
        for number, chunk in enumerate(chunks):
            if number == 0:
                first_chunk.wait(timeout=30)
            pieces.append(chunk.choices[0])
        texts[index] = (pieces[-1].finish_reason, "".join(c.text for c in pieces))

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    first_chunk.wait(timeout=30)  # every stream is generating
    plans = []
    reconfigure = threading.Thread(target=lambda: plans.append(engine.reconfigure(block_size=16)))
    reconfigure.start()
    wait_until(lambda: engine.is_reconfiguring)
    refused = httpx.post(f"{server.url}/v1/completions",
                         json={"model": server.model, "prompt": "not now", "max_tokens": 1})
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "reconfiguring"
    for worker in workers:
        worker.join(timeout=60)
    reconfigure.join(timeout=60)
    assert all(finish == "length" and text for finish, text in texts.values())
    assert len(texts) == 4
    assert plans[0].block_size == 16
    info = next(name for name in server.metrics() if "engine_config_info" in name)
    assert "block_size=16" in info
    assert_idle(server)
    assert server.engine.snapshot().block_size == 16
    assert client.completions.create(model=server.model, prompt="after", max_tokens=2).choices
    engine.reconfigure(block_size=8)


def test_engine_config_info_reports_resolved_values_and_no_created_series(tiny_llama_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_llama_path), device_memory_gb=0.05, max_model_len=128)).start()
    try:
        text = asyncio.run(EngineMetrics(engine, "tiny").render()).decode()
    finally:
        engine.shutdown()
    info = next(line for line in text.splitlines()
                if line.startswith("kvscope:engine_config_info"))
    assert f'model="{engine.model_path}"' in info and 'device="cpu"' in info
    # the model's dtype resolved (kv_cache_dtype="auto" means "the model's dtype", as vLLM's)
    assert ',dtype="auto"' not in info and (',dtype="float32"' in info
                                            or ',dtype="bfloat16"' in info)
    assert "_created" not in text


# ---- beam search over HTTP (vLLM's use_beam_search) -----------------------------------------
def test_completions_beam_search_returns_the_engines_best_n_beams(server) -> None:
    prompt = "beam me up"
    final = list(server.engine.submit(prompt, BeamSearchParams(3, 8)))[-1]
    expected = final.outputs
    completion = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=8, n=2, best_of=3,
        extra_body={"use_beam_search": True})
    assert [c.text for c in completion.choices] == [c.text for c in expected[:2]]
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.prompt_tokens == len(final.prompt_token_ids)
    assert_idle(server)


def test_an_answered_request_is_already_in_the_session_log(engine, tmp_path) -> None:
    """Acknowledged => logged: the final answer (a whole body, a stream's [DONE]) goes out
    only once the request's row is committed, so a kill -9 right after loses no answered
    request (bench/crash_loop.py checks it under load)."""
    log = SessionLog(tmp_path / "kv.db")
    log.start_session({}, engine.model_path)
    recorder = record_sessions(engine, log, poll_s=5.0)  # the poll alone would be late
    url, uvicorn_server, thread = serve(create_app(engine, durable=recorder.sync))
    reader = sqlite3.connect(tmp_path / "kv.db")

    def logged(response_id: str) -> bool:
        request_id = response_id.split("-", 1)[1]
        return reader.execute("SELECT COUNT(*) FROM requests WHERE request_id = ?",
                              (request_id,)).fetchone()[0] == 1

    try:
        body = {"prompt": "log me", "max_tokens": 3}
        assert logged(httpx.post(f"{url}/v1/completions", json=body).json()["id"])
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert logged(json.loads(events[0].removeprefix("data: "))["id"])
    finally:
        reader.close()
        uvicorn_server.should_exit = True
        thread.join(timeout=10)
        recorder.stop()
        log.close()


# Found by tests/fuzz: field names that are no identifier, and bodies that are no JSON
# (or not even UTF-8), were refused with param null.
@pytest.mark.parametrize(("content", "param"), [
    (json.dumps({"prompt": "x", "": 1}).encode(), ""),
    (json.dumps({"prompt": "x", "max tokens": 1}).encode(), "max tokens"),
    (b"{nope", "body"),
    (b"\xff\xfe", "body"),
])
def test_a_refused_body_or_field_is_named_whatever_its_name(server, content, param) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error


@pytest.mark.parametrize(("extra", "named"), [
    ({"stream": True}, "use_beam_search"),
    ({"max_tokens": None}, "max_tokens"),
    ({"n": 3, "best_of": 2}, "best_of"),
])
def test_completions_beam_search_refusals_name_the_field(server, extra, named) -> None:
    body = {"model": server.model, "prompt": "no beams", "max_tokens": 4,
            "use_beam_search": True, **extra}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert named in reply.json()["error"]["message"]


# ---- SIGTERM: open streams end with finish_reason "abort", not a cut connection ---------------
def test_sigterm_ends_open_streams_with_an_abort_and_done(tiny_chat_model_path, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), "--no-ui", "--graceful-shutdown-s", "0",
         "--model", str(tiny_chat_model_path), "--dtype", "float32", "--device", "cpu",
         "--db", str(tmp_path / "kv.db")],
        cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "Uvicorn running" in line or process.poll() is not None:
                break
        body = {"prompt": "keep talking", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:  # generating: now stop the server
                    process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) is not None
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) < 400  # cut short
