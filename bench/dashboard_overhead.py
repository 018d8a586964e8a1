"""What one open dashboard tab costs the engine it watches (JSON on stdout).

Starts `app.py`, then runs the same workload with no browser and with one headless
Chromium tab on the dashboard, alternating (A B B A ...) so drift on a shared machine
falls on both sides:

- single: one `/v1/completions` stream of `--tokens` greedy tokens; decode tok/s from
  its first to its last token;
- batched: `--batch` concurrent requests of `--batch-tokens` tokens; output tok/s;
- idle: the app process's CPU share over `--idle-s` seconds with no request.

Each also reports where the CPU went, in cores (CPU seconds per wall second; the
dashboard refreshes once a second, so also CPU seconds per refresh): the engine's
threads (named kvscope-engine, and the kernels' work-pool helpers, kvscope-pool), the
app's main thread (uvicorn's event loop: HTTP, SSE, Gradio's routes), the app's other
threads (Gradio's handler threads, session log, and torch's OpenMP workers, which are
unnamed: the batched GEMMs' engine work counts here too) and this bench's Chromium
processes.

Run it under the bench lock (the machine is shared):

    flock /work/bench.lock .venv/bin/python bench/dashboard_overhead.py > run1.json

The issue's targets are over three runs pooled (`--pool run1.json run2.json run3.json`).
"""

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from served import cpu_name, process_cpu_seconds, start_app, stop_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
# What one open tab may cost (issue 36): single-stream decode 5 %, batched throughput 3 %.
TARGET_COST = {"single_decode_tok_s": 0.05, "batched_tok_s": 0.03}


def stream_decode_rate(url: str, max_tokens: int) -> float:
    """Decode tok/s of one greedy streamed completion, first token to last."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    return (tokens - 1) / (last - first)


def batched_rate(url: str, batch: int, max_tokens: int) -> float:
    """Output tok/s of `batch` concurrent completions, wall clock."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
            "ignore_eos": True}

    def one(index: int) -> int:
        response = httpx.post(f"{url}/v1/completions", json={**body, "seed": index},
                              timeout=600)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(one, range(batch)))
    return tokens / (time.perf_counter() - started)


def cpu_seconds_by_part(app_pid: int) -> dict[str, float]:
    """CPU seconds so far of the engine's threads, the app's main thread, its other
    threads, and the Chromium processes this bench started (Linux /proc)."""
    parts = dict.fromkeys(("engine", "app_main", "app_other", "chromium"), 0.0)
    for task in Path(f"/proc/{app_pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() in ("kvscope-engine", "kvscope-pool"):
                part = "engine"
            else:
                part = "app_main" if task.name == str(app_pid) else "app_other"
            parts[part] += _cpu_seconds(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
    for pid in _descendants(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if b"chrom" in command:
                parts["chromium"] += _cpu_seconds(Path(f"/proc/{pid}/stat"))
        except OSError:
            continue
    return parts


def _cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def with_cpu_shares(app_pid: int, work) -> tuple[float, dict[str, float]]:
    """work()'s result, and each part's cores (CPU seconds per wall second) meanwhile."""
    before, started = cpu_seconds_by_part(app_pid), time.perf_counter()
    result = work()
    after, wall = cpu_seconds_by_part(app_pid), time.perf_counter() - started
    return result, {part: round((after[part] - before[part]) / wall, 4) for part in after}


def idle_cpu_share(pid: int, seconds: float) -> float:
    """The app process's CPU seconds per wall second (1.0 = one core busy)."""
    before, started = process_cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (process_cpu_seconds(pid) - before) / (time.perf_counter() - started)


class DashboardTab:
    """One headless Chromium with one dashboard tab (`page`), open inside the `with`."""

    def __init__(self, url: str, viewport: tuple[int, int] = (1400, 1100)) -> None:
        self.url = url
        self.viewport = viewport

    def __enter__(self) -> "DashboardTab":
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(executable_path=CHROMIUM,
                                                         args=CHROMIUM_ARGS)
        width, height = self.viewport
        self.page = self._browser.new_page(viewport={"width": width, "height": height})
        self.page.goto(self.url)
        self.page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=120_000)
        return self

    def __exit__(self, *exc) -> None:
        self._browser.close()
        self._playwright.stop()


def measure(app, args) -> dict:
    pid = app.process.pid
    single, single_cores = with_cpu_shares(pid, lambda: stream_decode_rate(app.url, args.tokens))
    batched, batched_cores = with_cpu_shares(
        pid, lambda: batched_rate(app.url, args.batch, args.batch_tokens))
    idle, idle_cores = with_cpu_shares(pid, lambda: idle_cpu_share(pid, args.idle_s))
    return {"single_decode_tok_s": single, "batched_tok_s": batched, "idle_cpu_share": idle,
            "cores": {"single": single_cores, "batched": batched_cores, "idle": idle_cores}}


def summarize(runs: dict[str, list[dict]]) -> dict:
    medians = {condition: {key: statistics.median(run[key] for run in condition_runs)
                           for key in condition_runs[0] if key != "cores"}
               for condition, condition_runs in runs.items()}
    for condition, condition_runs in runs.items():
        medians[condition]["cores"] = {
            phase: {part: statistics.median(run["cores"][phase][part] for run in condition_runs)
                    for part in condition_runs[0]["cores"][phase]}
            for phase in condition_runs[0]["cores"]}
    cost = {key: 1 - medians["one_tab"][key] / medians["no_tab"][key]
            for key in ("single_decode_tok_s", "batched_tok_s")}
    return {"median": medians, "cost_of_one_tab": cost,
            "target_cost": TARGET_COST,
            "target_met": all(cost[name] <= limit for name, limit in TARGET_COST.items())}


def pooled(paths: list[Path]) -> dict:
    """The runs of several outputs of this bench summarized as one run's (their medians)."""
    outputs = [json.loads(path.read_text()) for path in paths]
    runs = {condition: [run for output in outputs for run in output["runs"][condition]]
            for condition in ("no_tab", "one_tab")}
    return {"bench": "dashboard_overhead", "pooled": [str(path) for path in paths],
            "cpu": sorted({output["cpu"] for output in outputs}),
            "pairs": len(runs["one_tab"]), **summarize(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="A B B A blocks")
    parser.add_argument("--tokens", type=int, default=96, help="single stream's tokens")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests")
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="wait after opening the tab before measuring")
    parser.add_argument("--pool", nargs="+", type=Path, metavar="JSON",
                        help="measure nothing: summarize these runs' JSON outputs together "
                        "(the issue's three quiet runs, pooled)")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
    if args.pool:
        print(json.dumps(pooled(args.pool), indent=2))
        return
    app = start_app(args.app_args)
    try:
        stream_decode_rate(app.url, 8)  # warm-up, untimed
        runs: dict[str, list[dict]] = {"no_tab": [], "one_tab": []}
        order = ["no_tab", "one_tab", "one_tab", "no_tab"] * args.reps
        for condition in order:
            if condition == "one_tab":
                with DashboardTab(app.url):
                    time.sleep(args.settle_s)
                    runs[condition].append(measure(app, args))
            else:
                runs[condition].append(measure(app, args))
            print(condition, json.dumps(runs[condition][-1]), file=sys.stderr, flush=True)
        log_lines = len(app.log().splitlines())
    finally:
        stop_app(app)
    print(json.dumps({"bench": "dashboard_overhead", "app_args": args.app_args,
                      "workload": {"single_tokens": args.tokens, "batch": args.batch,
                                   "batch_tokens": args.batch_tokens},
                      "cpu": cpu_name(), "app_log_lines": log_lines,
                      **summarize(runs), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
