"""Engine replicas on a local Ray cluster (one for the whole module): routing, greedy parity
with one engine, routing decisions on /ws/events and in the log, per-replica /metrics, a
replica restarted and one killed mid-stream, and no Ray at all for one replica."""

import json
import os
import random
import string
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import ray
from conftest import free_port, serve, wait_until
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect as ws_connect

from kvscope.engine.config import EngineConfig
from kvscope.engine.entrypoints.llm import LLM
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.orchestrator.streams import RequestStream
from kvscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.engine.replicas.hit_outcomes import reusable_blocks
from kvscope.engine.replicas.replica_set import ReplicaDown, ReplicaSet, _Routed, connect_ray
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving import create_app
from kvscope.storage import SessionLog, record_sessions
from kvscope.ui.live import LiveFeeds
from kvscope.ui.panels import PanelRenderer
from kvscope.ui.replicas import overview_markdown, settled_totals

BLOCK_SIZE = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# 48 characters (the tiny chat model has one token per character): 12 full blocks.
SHARED_PREFIX = "You are kvscope's helpful test assistant. Reply: "
REPLICA_WAIT_S = 30  # what replicas report crosses Ray actors: seconds on a busy machine


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256)


def run(replicas: ReplicaSet, prompt: str, params: SamplingParams = GREEDY):
    stream = replicas.submit(prompt, params)
    final = list(stream)[-1]
    return replicas.recent_decisions[-1], final


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (each replica takes one of its CPUs)."""
    assert connect_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(ray_cluster, tiny_chat_model_path):
    """Two replicas, shared by the module's tests from the first that asks (in order: the
    last ones kill a replica, once to restart it, then for good)."""
    # Restarts on, as --restart-replicas: the last test's kill (no_restart) stays down.
    replica_set = ReplicaSet(config(tiny_chat_model_path), 2, restart_replicas=True)
    yield replica_set
    replica_set.shutdown()


def test_offline_llm_on_replicas_equals_one_engine(ray_cluster, tiny_chat_model_path) -> None:
    """First in the module: its two replicas are stopped before the shared ones start."""
    prompts = [SHARED_PREFIX + "offline", "Hello there", [5, 6, 7, 8, 9]]
    knobs = {"dtype": "float32", "device": "cpu", "block_size": BLOCK_SIZE,
             "num_gpu_blocks_override": NUM_BLOCKS, "max_model_len": 256}
    llm = LLM(str(tiny_chat_model_path), replicas=2, routing="round-robin", **knobs)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert {d.replica for d in llm.replicas.recent_decisions} == {0, 1}
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate("x" * 300, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    expected = LLM(str(tiny_chat_model_path), **knobs).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]


def test_shared_prefixes_stick_under_kv_aware_and_spread_under_round_robin(replicas) -> None:
    replicas.set_routing("kv-aware")
    first, _ = run(replicas, SHARED_PREFIX + "one")
    home = first.replica
    # The replica's block events reach the router's index: every full prompt block.
    wait_until(lambda: replicas.replica_statuses()[home].num_indexed_blocks >= 12,
               REPLICA_WAIT_S)
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


def test_the_router_view_of_a_shared_prefix_trace_equals_the_routers_counters(replicas) -> None:
    """200 requests over 8 shared prefixes on 2 replicas whose pools hold less than all of
    them, in bursts of 10: the view's predicted hits are the decisions' matches, its
    actual hits the ones the clients saw, and both equal the router's counters; once idle
    the router's index equals each replica's prefix cache."""
    replicas.set_routing("kv-aware")
    before = replicas.router_view().totals
    rng = random.Random(0)
    # 90 characters each: 22 full blocks, 8 of them more than both pools (2 x 96) hold
    # beside the requests' own blocks, so some predicted blocks are evicted.
    systems = [f"Tenant {t}: " + "".join(rng.choices(string.ascii_lowercase, k=80))
               for t in range(8)]
    prompts = [rng.choice(systems) + f" q{i}" for i in range(200)]
    params = SamplingParams(max_tokens=1, temperature=0)
    finals = []
    for start in range(0, len(prompts), 10):
        streams = [replicas.submit(prompt, params) for prompt in prompts[start:start + 10]]
        # Asked while the burst runs, as the dashboard does: the replicas' answers must
        # not cost the index any block event (the last check below).
        replicas.router_view()
        finals += [list(stream)[-1] for stream in streams]
    wait_until(lambda: replicas.router_view().totals.requests == before.requests + 200,
               REPLICA_WAIT_S)
    view = replicas.router_view()
    totals = view.totals.since(before)
    ids = {final.request_id for final in finals}
    trace = tuple(outcome for outcome in view.outcomes if outcome.request_id in ids)
    assert len(trace) == 200 and settled_totals(trace) == totals  # what the panel sums
    assert totals.actual_tokens == sum(final.num_cached_tokens for final in finals) > 0
    prompt_tokens = {final.request_id: len(final.prompt_token_ids) for final in finals}
    decisions = [d for d in replicas.recent_decisions if d.request_id in ids]
    assert len(decisions) == 200
    assert totals.predicted_tokens == BLOCK_SIZE * sum(
        min(d.matched_blocks, reusable_blocks(prompt_tokens[d.request_id], BLOCK_SIZE))
        for d in decisions) > 0
    assert totals.misses == sum(totals.misses_by_reason.values()) == sum(
        outcome.actual_tokens < outcome.predicted_tokens for outcome in trace)

    def index_equals_caches() -> bool:
        comparisons = replicas.router_view().replicas
        return len(comparisons) == 2 and all(
            c.events_behind == c.believed_but_evicted == c.cached_but_unknown == 0
            and c.believed_blocks == c.cached_blocks > 0 for c in comparisons)

    wait_until(index_equals_caches, REPLICA_WAIT_S)


@contextmanager
def dashboard(replicas: ReplicaSet):
    """The dashboard on `replicas`, on a free loopback port; yields its url."""
    from kvscope.ui import build_ui

    blocks = build_ui(replicas)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        blocks.close()


def test_the_dashboard_shows_every_replica_and_its_routing(replicas) -> None:
    assert isinstance(replicas, EngineView)  # what every front end reads
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from gradio_client import Client

    with dashboard(replicas) as url:
        client = Client(url, verbose=False)
        run(replicas, SHARED_PREFIX + "dashboard")
        decision = replicas.recent_decisions[-1]

        def overview():
            return client.predict(api_name="/refresh_replicas")

        wait_until(lambda: all(f"{NUM_BLOCKS} blocks" in plot["plot"]
                               for plot in overview()[2:]), REPLICA_WAIT_S)
        summary, decisions, *heatmaps = overview()
        assert "2 replicas" in summary and "routing **kv-aware**" in summary
        assert len(heatmaps) == 2
        newest = decisions["data"][0]
        assert newest[:3] == [decision.request_id, "kv-aware", decision.replica]
        assert "r0:" in newest[4] and "r1:" in newest[4]
        belief, misses = client.predict(api_name="/refresh_router")
        totals = replicas.router_view().totals
        assert (f"predicted **{totals.predicted_tokens}**, actual **{totals.actual_tokens}**"
                in belief)
        assert "| 0 |" in belief and "| 1 |" in belief  # both replicas' index and cache
        assert misses["headers"][-1] == "why"
        status = client.predict("least-loaded", 0.5, api_name="/set_routing")
        assert "least-loaded" in status and replicas.routing == "least-loaded"
        client.predict("kv-aware", 1.0, api_name="/set_routing")
        other = 1 - decision.replica
        live = client.predict(None, None, "whole pool", 0, 0, "most recent", 1, "", other,
                              api_name="/refresh_live")  # this tab's replica
        assert f"{NUM_BLOCKS} blocks" in live[1]["plot"]  # the other replica's pool
        assert f"replica {other}</strong> of 2" in live[0]  # the summary names it


def test_browser_the_replica_pick_sits_above_its_pool_and_no_replicas_text_is_clipped(
        replicas, browser) -> None:
    """At 1280 px the Live tab's replica pick is above the heatmap it picks (it sat about
    1,500 px below it under load), and the Replicas tab's text, its decision table's
    headers over a row among them, is whole. bench/clipped_text.py reads every tab."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from clipped_text import CLIPPED_TEXT_JS

    with dashboard(replicas) as url:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(url)
            page.locator("#kv-heatmap").wait_for()
            pick = page.locator("#kv-replica").bounding_box()
            pool = page.locator("#kv-heatmap").bounding_box()
            assert 0 <= pool["y"] - (pick["y"] + pick["height"]) < 100, (pick, pool)
            run(replicas, SHARED_PREFIX + "headers")  # a decision row under the headers
            page.get_by_role("tab", name="Replicas").click()
            page.locator('#kv-routing-decisions [data-testid="cell-0-0"]').wait_for(
                timeout=REPLICA_WAIT_S * 1000)
            clipped = page.evaluate(CLIPPED_TEXT_JS)
        finally:
            page.close()
        assert clipped == [], json.dumps(clipped, indent=1)


def test_routing_decisions_reach_the_websocket_the_log_and_metrics_per_replica(
        replicas, tmp_path) -> None:
    url, server, thread = serve(create_app(replicas))
    session_log = SessionLog(tmp_path / "app.db")
    session_log.start_session({}, model="tiny")
    stop_recording = record_sessions(replicas, session_log)  # the app's recorder
    try:
        with ws_connect(url.replace("http", "ws") + "/ws/events") as websocket:
            websocket.recv(timeout=10)  # the pool snapshot: the feeds are subscribed
            replicas.set_routing("round-robin")  # both replicas serve one
            decisions = [run(replicas, SHARED_PREFIX + word)[0] for word in ("ws", "log")]
            replicas.set_routing("kv-aware")
            sent = {}
            while len(sent) < 2:
                message = json.loads(websocket.recv(timeout=10))
                if message["type"] == "routing":
                    sent.update((d["request_id"], d) for d in message["decisions"])
        for decision in decisions:
            assert sent[decision.request_id] == {
                "request_id": decision.request_id, "time": decision.time,
                "policy": "round-robin", "replica": decision.replica,
                "num_prompt_blocks": decision.num_prompt_blocks,
                "matched_blocks": decision.matched_blocks,
                "candidates": [{"replica": c.replica, "matched_blocks": c.matched_blocks,
                                "load": c.load, "score": c.score}
                               for c in decision.candidates]}
        assert {decision.replica for decision in decisions} == {0, 1}

        stop_recording()
        assert session_log.flush()
        logged = {row["request_id"]: row
                  for row in session_log.load_session(session_log.session_id).routing_decisions}
        for decision in decisions:
            row = sent[decision.request_id]
            assert {key: logged[decision.request_id][key] for key in row} == row

        # Every engine series is per replica; both replicas' gauges and counters are there.
        wait_until(lambda: all(s.counters.prompt_tokens for s in replicas.replica_statuses()),
                   REPLICA_WAIT_S)
        families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))
        per_replica = [family for family in families  # one engine config for all replicas
                       if not family.name.startswith("kvscope:engine_config")]
        # (vLLM's series name the replica as their engine, kvscope's as their replica.)
        label = {family.name: "engine" if family.name.startswith("vllm:") else "replica"
                 for family in per_replica}
        for family in per_replica:
            assert all(label[family.name] in sample.labels for sample in family.samples), (
                family.name)
        replicas_of = {family.name: {sample.labels[label[family.name]]
                                     for sample in family.samples}
                       for family in per_replica}
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                     "vllm:prompt_tokens", "vllm:prefix_cache_hits", "kvscope:replica_up"):
            assert replicas_of[name] == {"0", "1"}, name
        assert replicas_of["vllm:time_to_first_token_seconds"] >= {"0", "1"}
    finally:
        session_log.close()
        server.should_exit = True
        thread.join(timeout=10)


def test_a_restarted_replica_serves_again_and_nothing_is_lost(replicas) -> None:
    """--restart-replicas: Ray restarts a killed replica's actor; its in-flight stream
    fails, the other replica's finishes, and the restarted one takes requests again."""
    url, server, thread = serve(create_app(replicas))
    try:
        replicas.set_routing("round-robin")
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        streams = [iter(replicas.submit(f"restart {i}", long)) for i in range(2)]
        firsts = [next(stream) for stream in streams]  # both are generating
        assert all(first.outputs[0].token_ids for first in firsts)
        victim = replicas.recent_decisions[-1].replica  # the second request's replica
        ray.kill(replicas._replicas[victim].actor, no_restart=False)
        with pytest.raises(ReplicaDown, match=f"replica {victim} died"):
            list(streams[1])
        assert list(streams[0])[-1].outputs[0].finish_reason == "length"  # not lost
        wait_until(lambda: replicas.replica_statuses()[victim].restarts == 1, timeout=120)
        status = replicas.replica_statuses()[victim]
        assert status.alive and status.error is None
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert f'replica="{victim}"}} 1.0' in next(
            line for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("kvscope:replica_up") and f'replica="{victim}"' in line)
        assert f"| {victim} | up |" in overview_markdown(replicas, replicas.replica_statuses())
        served = {run(replicas, f"again {i}")[0].replica for i in range(2)}
        assert served == {0, 1}  # round-robin sends the restarted replica its turn
        replicas.set_routing("kv-aware")
        for replica in (0, 1):
            wait_until(lambda r=replica: replicas.replica_statuses()[r].in_flight == 0,
                       REPLICA_WAIT_S)
            snapshot = replicas.snapshot(replica=replica)
            assert snapshot.count("used") + snapshot.count("shared") == 0  # no leaked block
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_killed_replica_fails_its_streams_and_the_rest_keep_serving(replicas,
                                                                     tmp_path) -> None:
    url, server, thread = serve(create_app(replicas))
    session_log = SessionLog(tmp_path / "app.db")
    session_log.start_session({}, model="tiny")
    recorder = record_sessions(replicas, session_log)
    errors_before = replicas.counters().requests_finished.get("error", 0)
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
        # The request that died with its replica is logged, with the tokens it had.
        assert recorder.sync()
        rows = session_log.load_session(session_log.session_id).requests
        died = [row for row in rows if row["error"]]
        assert len(died) == 1 and f"replica {victim} died" in died[0]["error"]
        assert died[0]["replica"] == victim and died[0]["prompt"] == "kill 1"
        assert died[0]["finish_reason"] == "abort" and died[0]["num_output_tokens"] >= 1
        assert died[0]["prompt_token_ids"] and died[0]["sampling_params"]["max_tokens"] == 200
        assert replicas.counters().requests_finished["error"] == errors_before + 1
        survivor = 1 - victim
        wait_until(lambda: not replicas.replica_statuses()[victim].alive, REPLICA_WAIT_S)
        # The Live tab showing that replica says so above its (last) panels.
        summary = PanelRenderer(LiveFeeds(replicas)).refresh(
            None, ["summary"], "whole pool", None, None, "most recent", 1, "", victim)[0]
        assert f"replica {victim} is down" in summary
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
        wait_until(lambda: replicas.replica_statuses()[survivor].in_flight == 0, REPLICA_WAIT_S)
        snapshot = replicas.snapshot(replica=survivor)
        assert snapshot.replica == survivor
        assert snapshot.count("used") + snapshot.count("shared") == 0  # no leaked block
    finally:
        recorder.stop()
        server.should_exit = True
        thread.join(timeout=10)


def test_a_request_that_dies_with_its_replica_is_recorded_as_it_stood() -> None:
    """Found by the soak: a beam search (no `n`) dying with its replica raised while its
    record was built, which left the replica's other streams unfailed and the replica
    never restarted."""
    stream = RequestStream("r", "api", lambda: None)
    for params, samples in ((SamplingParams(n=2, max_tokens=4), 2),
                            (BeamSearchParams(beam_width=3, max_tokens=4), 3)):
        record = _Routed(stream, "hi", [1, 2], params, 100.0).failed_record(1, "replica 1 died")
        assert (record.finish_reason, record.error, record.replica) == ("error",
                                                                        "replica 1 died", 1)
        output = record.output
        assert output.finished and output.error == "replica 1 died"
        assert (output.prompt, output.prompt_token_ids) == ("hi", [1, 2])
        assert [(c.token_ids, c.finish_reason) for c in output.outputs] == [([], "abort")] * samples
        assert output.metrics.arrival_time == 100.0 and output.metrics.finished_time > 100.0

    routed = _Routed(stream, [5, 6], [5, 6], SamplingParams(max_tokens=4), 100.0)
    routed.last = RequestOutput("r", None, [5, 6], [CompletionOutput(0, "ab", [7, 8])], False,
                                metrics=RequestMetrics(99.0, first_token_time=99.5),
                                deltas=["b"])
    output = routed.failed_record(0, "replica 0 died").output
    assert [(c.text, c.token_ids, c.finish_reason) for c in output.outputs] == [
        ("ab", [7, 8], "abort")]
    assert output.metrics.first_token_time == 99.5 and output.deltas == []
    assert not routed.last.finished and routed.last.outputs[0].finish_reason is None


def test_one_replica_starts_no_ray(tiny_chat_model_path) -> None:
    script = (
        "import sys\nfrom kvscope import app\n"
        f"args = app.build_parser().parse_args(['--model', {str(tiny_chat_model_path)!r}, "
        "'--dtype', 'float32', '--device', 'cpu', '--num-gpu-blocks-override', '32'])\n"
        "engine = app.start_engine(args)\n"
        "print(type(engine).__name__, 'ray' in sys.modules)\n"
        "engine.shutdown()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.split() == ["AsyncEngine", "False"]
