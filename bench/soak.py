"""A long soak of the served app: mixed traffic, a dashboard tab polling in Chromium, KV
cache reconfigures every few minutes and, with --replicas 2, a replica killed and
restarted; prints a JSON report.

Traffic: chat streams (some hung up mid-answer), n > 1, beam search, structured outputs.
The report: RSS and Python object counts over time with their fitted growth per hour
(after warm-up), KV blocks held once the traffic stops (must be 0), requests lost or
stuck, TTFT p99 per window, and the session log's request rows against requests served.

    python bench/soak.py --minutes 30 [--replicas 2]
"""

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from dashboard_overhead import DashboardTab
from gradio_client import Client
from served import ROOT, cpu_name, start_app, stop_app
from soak_probe import rss_bytes

REQUEST_TIMEOUT_S = 120  # an answer later than this counts as stuck
KINDS = ("chat_stream", "hang_up", "n_samples", "beam_search", "structured", "completion")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
REPLICA_PROCESS = "ray::EngineReplica"


@dataclass
class Outcomes:
    """What every request of the soak got, shared by the client threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: dict = field(default_factory=dict)
    ttfts: list = field(default_factory=list)  # (time, seconds) of each chat stream
    lost: list = field(default_factory=list)  # (time, kind, what)

    def add(self, outcome: str, kind: str) -> None:
        with self.lock:
            key = f"{kind}:{outcome}"
            self.counts[key] = self.counts.get(key, 0) + 1


def body_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choice(["kv", "cache", "block", "page", "token", "prefix"])
                     for _ in range(rng.randint(3, 40)))
    chat = {"messages": [{"role": "user", "content": f"Tell me about {words}"}],
            "max_tokens": rng.randint(4, 32)}
    if kind in ("chat_stream", "hang_up"):
        return "/v1/chat/completions", {**chat, "stream": True}
    if kind == "n_samples":
        return "/v1/chat/completions", {**chat, "n": rng.randint(2, 3), "temperature": 0.8}
    if kind == "beam_search":
        return "/v1/completions", {"prompt": words, "max_tokens": 8, "n": 2, "best_of": 3,
                                   "use_beam_search": True}
    if kind == "structured":
        return "/v1/chat/completions", {**chat, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    return "/v1/completions", {"prompt": words, "max_tokens": rng.randint(4, 32)}


def client(url: str, stop: threading.Event, outcomes: Outcomes, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        while not stop.is_set():
            kind = rng.choice(KINDS)
            path, body = body_for(kind, rng)
            started = time.monotonic()
            try:
                if body.get("stream"):
                    outcome = stream(http, path, body, kind, started, outcomes, rng)
                else:
                    answer = http.post(path, json=body)
                    outcome = "answered" if answer.status_code == 200 else str(answer.status_code)
            except httpx.TimeoutException:
                outcome = "stuck"
            except httpx.HTTPError as error:
                outcome = "lost"
                with outcomes.lock:
                    outcomes.lost.append((time.time(), kind, repr(error)[:200]))
            outcomes.add(outcome, kind)
            if outcome == "503":
                time.sleep(1)  # a reconfigure in progress: retry after it


def stream(http: httpx.Client, path: str, body: dict, kind: str, started: float,
           outcomes: Outcomes, rng: random.Random) -> str:
    hang_up_after = rng.randint(1, 6) if kind == "hang_up" else None
    with http.stream("POST", path, json=body) as answer:
        if answer.status_code != 200:
            answer.read()
            return str(answer.status_code)
        chunks = 0
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "answered"
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return f"stream_error:{chunk['error'].get('code')}"
            if chunks == 0 and any(c["delta"].get("content") for c in chunk["choices"]):
                with outcomes.lock:
                    outcomes.ttfts.append((time.time(), time.monotonic() - started))
                chunks = 1
            elif chunks:
                chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return "hung_up"  # leaving the `with` closes the connection
    return "cut"  # the stream ended without [DONE]


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def replica_pids(app_pid: int) -> list[int]:
    """The app's own replica processes: descendants of `app_pid` (Ray's raylet starts
    them), not the replicas of any other kvscope running on the machine."""
    parents, replicas = {}, []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if (proc / "cmdline").read_bytes().startswith(REPLICA_PROCESS.encode()):
                    replicas.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                pass

    def descends_from_app(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == app_pid:
                return True
        return False

    return sorted(pid for pid in replicas if descends_from_app(pid))


def process_rss(pid: int) -> int:
    try:
        return rss_bytes(pid)
    except OSError:  # a replica that died since it was listed
        return 0


def growth_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """The least-squares slope, as a fraction of the mean per hour."""
    if len(samples) < 3:
        return None
    times, values = zip(*samples, strict=True)
    slope = statistics.linear_regression(times, values).slope
    return slope * 3600 / statistics.fmean(values)


def reconfigure(client_: Client, defaults: list, block_size: int, utilization: float) -> str:
    values = [block_size, utilization, *defaults[2:-1], False]  # not aborting running ones
    return str(client_.predict(*values, api_name="/apply_knobs"))[:120]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--reconfigure-every-s", type=float, default=180)
    parser.add_argument("--kill-replica-every-s", type=float, default=300)
    parser.add_argument("--window-s", type=float, default=300, help="TTFT p99 window")
    parser.add_argument("--warmup-s", type=float, default=60,
                        help="samples before this are left out of the growth fits")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-soak-"))
    probe_path = workdir / "probe.jsonl"
    db = workdir / "kvscope.db"
    app_args = ["--db", str(db), "--log-level", "warning", "--max-model-len", "1024"]
    if args.model:
        app_args += ["--model", args.model]
    if args.replicas > 1:
        app_args += ["--replicas", str(args.replicas), "--restart-replicas"]
    app = start_app(app_args, env={"KVSCOPE_SOAK_PROBE": str(probe_path)},
                    wrapper=[str(ROOT / "bench" / "soak_probe.py")])
    outcomes, stop = Outcomes(), threading.Event()
    events, rss = [], []
    started = time.time()
    try:
        gradio = Client(f"{app.url}/", verbose=False)
        defaults = [p["parameter_default"] for p in gradio.view_api(
            return_format="dict", print_info=False)["named_endpoints"]["/apply_knobs"]["parameters"]]
        threads = [threading.Thread(target=client, args=(app.url, stop, outcomes, args.seed + i),
                                    daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        with DashboardTab(f"{app.url}/") as tab:
            polls = []
            tab.page.on("request", lambda r: polls.append(1) if r.url.endswith("/refresh_live")
                        else None)
            next_reconfigure = started + args.reconfigure_every_s
            next_kill = started + args.kill_replica_every_s
            configs = [(16, 0.9), (32, 0.8)]
            while time.time() < started + args.minutes * 60:
                tab.page.wait_for_timeout(5000)  # Playwright's events are served meanwhile
                now = time.time()
                replicas = replica_pids(app.process.pid)
                rss.append((now, sum(process_rss(pid) for pid in [app.process.pid, *replicas])))
                if now >= next_reconfigure:
                    block_size, utilization = configs[len(events) % 2]
                    events.append({"t": now - started, "reconfigure": [block_size, utilization],
                                   "status": reconfigure(gradio, defaults, block_size, utilization)})
                    next_reconfigure = now + args.reconfigure_every_s
                if args.replicas > 1 and now >= next_kill and replicas:
                    os.kill(replicas[0], signal.SIGKILL)
                    events.append({"t": now - started, "killed_replica_pid": replicas[0]})
                    next_kill = now + args.kill_replica_every_s
            dashboard_polls = len(polls)
        stop.set()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S)
        time.sleep(5)  # aborted hang-ups and the last steps settle
        idle = {name: metric_sum(app.url, name) for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
        health = httpx.get(f"{app.url}/health", timeout=10).json()
    finally:
        stop.set()
        stop_app(app)  # SIGTERM: the session log closes
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
        finish = dict(connection.execute(
            "SELECT finish_reason, COUNT(*) FROM requests GROUP BY finish_reason").fetchall())
    probes = [json.loads(line) for line in probe_path.read_text().splitlines()]
    warm = started + args.warmup_s
    windows = {}
    for at, ttft in outcomes.ttfts:
        windows.setdefault(int((at - started) // args.window_s), []).append(ttft)
    ttft_p99 = {f"{k * args.window_s / 60:g}-{(k + 1) * args.window_s / 60:g} min":
                statistics.quantiles(v, n=100)[98] if len(v) > 1 else v[0]
                for k, v in sorted(windows.items())}
    answered = sum(v for k, v in outcomes.counts.items() if k.endswith(":answered"))
    hung_up = sum(v for k, v in outcomes.counts.items() if k.endswith(":hung_up"))
    # Admitted, then failed in the open (a replica died under them): logged as errors.
    failed = sum(v for k, v in outcomes.counts.items()
                 if k.endswith(":500") or ":stream_error:" in k)
    p99s = list(ttft_p99.values())
    print(json.dumps({
        "bench": "soak", "cpu": cpu_name(), "minutes": args.minutes, "replicas": args.replicas,
        "clients": args.clients, "outcomes": dict(sorted(outcomes.counts.items())),
        "requests_lost": len(outcomes.lost), "lost_examples": outcomes.lost[:5],
        "requests_stuck": sum(v for k, v in outcomes.counts.items() if k.endswith(":stuck")),
        "idle_after_traffic": idle,
        "kv_blocks_in_use_idle_fraction": idle["vllm:kv_cache_usage_perc"],
        "health_at_end": health,
        "rss_growth_per_hour": growth_per_hour([s for s in rss if s[0] >= warm]),
        "app_objects_growth_per_hour": growth_per_hour(
            [(p["t"], p["objects"]) for p in probes if p["t"] >= warm]),
        "rss_mb": [[round(t - started), round(v / 2**20)] for t, v in rss[::6]],
        "app_objects": [[round(p["t"] - started), p["objects"]] for p in probes],
        "ttft_p99_s_per_window": ttft_p99,
        "ttft_p99_last_over_first": p99s[-1] / p99s[0] if len(p99s) > 1 else None,
        "sqlite_request_rows": rows, "sqlite_finish_reasons": finish,
        "requests_answered": answered, "requests_hung_up": hung_up,
        "requests_failed": failed,
        "rows_cover_answered_hung_up_and_failed": rows >= answered + hung_up + failed,
        "dashboard_polls": dashboard_polls, "events": events}, indent=1))


if __name__ == "__main__":
    main()
