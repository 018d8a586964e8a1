"""Engine replicas on a local Ray cluster (one for the whole module): routing, greedy parity
with one engine, a replica killed mid-stream, and no Ray at all for one replica."""

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import ray
from conftest import serve

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.replicas.replica_set import ReplicaSet, connect_ray
from engine.sampling_params import SamplingParams
from engine.serving import create_app

BLOCK_SIZE = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# 48 characters (the tiny chat model has one token per character): 12 full blocks.
SHARED_PREFIX = "You are kvscope's helpful test assistant. Reply: "


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(replicas: ReplicaSet, prompt: str, params: SamplingParams = GREEDY):
    stream = replicas.submit(prompt, params)
    final = list(stream)[-1]
    return replicas.recent_decisions[-1], final


@pytest.fixture(scope="module")
def replicas(tiny_chat_model_path):
    """Two replicas on one local Ray cluster, shared by the module's tests (in order: the
    last one kills replica 1)."""
    assert connect_ray()
    replica_set = ReplicaSet(config(tiny_chat_model_path), 2)
    yield replica_set
    replica_set.shutdown()
    ray.shutdown()


def test_shared_prefixes_stick_under_kv_aware_and_spread_under_round_robin(replicas) -> None:
    replicas.set_routing("kv-aware")
    first, _ = run(replicas, SHARED_PREFIX + "one")
    home = first.replica
    # The replica's block events reach the router's index: every full prompt block.
    wait_until(lambda: replicas.replica_statuses()[home].num_indexed_blocks >= 12)
    for word in ("two", "three", "four"):
        decision, output = run(replicas, SHARED_PREFIX + word)
        assert decision.replica == home and decision.matched_blocks >= 12
        assert output.num_cached_tokens >= 12 * BLOCK_SIZE
    replicas.set_routing("round-robin")
    chosen = {run(replicas, SHARED_PREFIX + word)[0].replica for word in ("a", "b", "c", "d")}
    assert chosen == {0, 1}
    replicas.set_routing("kv-aware")
    with pytest.raises(ValueError, match="routing="):
        replicas.set_routing("fastest")


def test_outputs_equal_one_engines_greedy(replicas, tiny_chat_model_path) -> None:
    prompts = [SHARED_PREFIX + "parity", "Hello there", "A different prompt entirely"]
    replicas.set_routing("round-robin")  # both replicas serve some
    served = [replicas.submit(prompt, GREEDY) for prompt in prompts]
    finals = [list(stream)[-1] for stream in served]
    replicas.set_routing("kv-aware")
    single = EngineCore(config(tiny_chat_model_path))
    for prompt, final in zip(prompts, finals, strict=True):
        single.add_request(prompt, GREEDY, request_id=prompt)
    expected = {}
    while single.has_unfinished_requests():
        expected.update((o.request_id, o) for o in single.step().outputs if o.finished)
    for prompt, final in zip(prompts, finals, strict=True):
        assert final.outputs[0].token_ids == expected[prompt].outputs[0].token_ids
        assert final.outputs[0].text == expected[prompt].outputs[0].text


def test_the_dashboard_shows_every_replica_and_its_routing(replicas) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from gradio_client import Client

    from ui import build_ui

    blocks = build_ui(replicas)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        run(replicas, SHARED_PREFIX + "dashboard")
        decision = replicas.recent_decisions[-1]

        def overview():
            return client.predict(api_name="/refresh_replicas")

        wait_until(lambda: all(f"{NUM_BLOCKS} blocks" in plot["plot"]
                               for plot in overview()[2:]))
        summary, decisions, *heatmaps = overview()
        assert "2 replicas" in summary and "routing **kv-aware**" in summary
        assert len(heatmaps) == 2
        newest = decisions["data"][0]
        assert newest[:3] == [decision.request_id, "kv-aware", decision.replica]
        assert "r0:" in newest[4] and "r1:" in newest[4]
        status = client.predict("least-loaded", 0.5, api_name="/set_routing")
        assert "least-loaded" in status and replicas.routing == "least-loaded"
        client.predict("kv-aware", 1.0, api_name="/set_routing")
        other = 1 - decision.replica
        assert str(other) in client.predict(other, api_name="/focus_replica")
        live = client.predict(api_name="/refresh_live")
        assert f"{NUM_BLOCKS} blocks" in live[1]["plot"]  # the other replica's pool
    finally:
        blocks.close()


def test_a_killed_replica_fails_its_streams_and_the_rest_keep_serving(replicas) -> None:
    url, server, thread = serve(create_app(replicas))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        replicas.set_routing("round-robin")
        long = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}
        streams = [client.completions.create(model=replicas.model_path, prompt=f"kill {i}",
                                             stream=True, **long) for i in range(2)]
        firsts = [next(iter(stream)) for stream in streams]  # both are generating
        assert all(first.choices for first in firsts)
        victim = replicas.recent_decisions[-1].replica  # the second request's replica
        ray.kill(replicas._replicas[victim].actor)
        with pytest.raises(openai.APIError, match=f"replica {victim} died"):
            for _ in streams[1]:
                pass
        survivor = 1 - victim
        wait_until(lambda: not replicas.replica_statuses()[victim].alive)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [r["alive"] for r in health.json()["replicas"]] == [victim != 0, victim != 1]
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvscope:replica_up{{model_name="{replicas.model_path.rsplit("/", 1)[-1]}",' \
               f'replica="{victim}"}} 0.0' in metrics
        # The survivor finishes its stream and takes every new request.
        assert list(streams[0])[-1].choices[0].finish_reason == "length"
        replicas.set_routing("kv-aware")
        for i in range(3):
            done = client.completions.create(model=replicas.model_path, prompt=f"after {i}",
                                             max_tokens=4)
            assert done.choices[0].text
            assert replicas.recent_decisions[-1].replica == survivor
        wait_until(lambda: replicas.replica_statuses()[survivor].in_flight == 0)
        snapshot = replicas.snapshot(replica=survivor)
        assert snapshot.replica == survivor
        assert snapshot.count("used") + snapshot.count("shared") == 0  # no leaked block
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_one_replica_starts_no_ray(tiny_chat_model_path) -> None:
    script = (
        "import sys, app\n"
        f"args = app.build_parser().parse_args(['--model', {str(tiny_chat_model_path)!r}, "
        "'--dtype', 'float32', '--device', 'cpu', '--num-gpu-blocks-override', '32'])\n"
        "engine = app.start_engine(args)\n"
        "print(type(engine).__name__, 'ray' in sys.modules)\n"
        "engine.shutdown()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.split() == ["AsyncEngine", "False"]
