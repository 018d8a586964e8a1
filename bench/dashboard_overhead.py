"""What one open dashboard tab costs the engine it watches (JSON on stdout).

Starts `app.py`, then runs the same workload with no browser and with one headless
Chromium tab on the dashboard, alternating (A B B A ...) so drift on a shared machine
falls on both sides:

- single: one `/v1/completions` stream of `--tokens` greedy tokens; decode tok/s from
  its first to its last token;
- batched: `--batch` concurrent requests of `--batch-tokens` tokens; output tok/s;
- idle: the app process's CPU share over `--idle-s` seconds with no request.

Run it under the bench lock (the machine is shared):

    flock /work/bench.lock .venv/bin/python bench/dashboard_overhead.py
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import cpu_name, process_cpu_seconds, start_app, stop_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
TARGET_COST = 0.10


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
    return {"single_decode_tok_s": stream_decode_rate(app.url, args.tokens),
            "batched_tok_s": batched_rate(app.url, args.batch, args.batch_tokens),
            "idle_cpu_share": idle_cpu_share(app.process.pid, args.idle_s)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    medians = {condition: {key: statistics.median(run[key] for run in condition_runs)
                           for key in condition_runs[0]}
               for condition, condition_runs in runs.items()}
    cost = {key: 1 - medians["one_tab"][key] / medians["no_tab"][key]
            for key in ("single_decode_tok_s", "batched_tok_s")}
    return {"median": medians, "cost_of_one_tab": cost,
            "target_cost": TARGET_COST,
            "target_met": all(value <= TARGET_COST for value in cost.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="A B B A blocks")
    parser.add_argument("--tokens", type=int, default=96, help="single stream's tokens")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests")
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="wait after opening the tab before measuring")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
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
