"""The live views at GPU-scale pools: what telemetry costs the engine thread, what one
dashboard refresh costs its reader, and how many bytes a refresh sends, for pools of
3k to 1M blocks (block_size 1, num_gpu_blocks_override, a tiny random model).

Per pool size: an AsyncEngine on a 2-layer random Llama, the dashboard's LiveFeed and its
refresh handler (the function gr.Timer calls), and 16 requests kept in flight (a shared
32-token prefix, so blocks are shared and cached; finished ones are replaced).

Reported per size (JSON on stdout):
- engine_telemetry_ms_per_step: time the engine thread spends on telemetry, summed over
  the run and divided by its steps (step records, pool deltas, snapshots for readers);
- engine_max_pause_ms: the longest single telemetry call on the engine thread, and what
  it was: engine_max_pause_gc_ms of it went to garbage collections (on any thread: one
  holds the GIL throughout) and engine_max_pause_gc_generation says the oldest collected;
  engine_max_pause_cpu_ms: the most CPU time the engine thread spent in one telemetry
  call (on a shared machine the wall-clock pause also counts time the OS gave to others);
- gc: Python's collections during the measured part, per generation, the longest full
  (generation 2) one, in wall and CPU time, the longest on the engine thread (a collection
  holds the GIL, so one on another thread pauses the engine too, unless it is inside
  torch), and the objects a full collection walks (the tracked ones, generation 2 of them;
  frozen objects are not walked). The measured part starts once the dashboard's step
  history is full (ui.live.HISTORY_STEPS steps), as after a long run;
- refresh_ms: a new tab's first refresh; every panel built afresh under load (a new
  renderer: nothing cached or throttled); an open tab's refresh under load, once a second
  (only panels whose data changed, as often as their cost allows); and while idle. Wall
  clock, and *_cpu_mean: the refreshing thread's CPU time (without its waits for the GIL
  and for a core);
- bytes: the payload of each of those refreshes (skipped panels send nothing).

Usage:
  flock /work/bench.lock .venv/bin/python bench/dashboard_scale.py            # 3k..1M
  .venv/bin/python bench/dashboard_scale.py --sizes 3000 --refreshes 3       # a quick look
"""

import argparse
import functools
import gc
import importlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from random_model import save_random_llama  # noqa: E402

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.orchestrator.async_engine import AsyncEngine  # noqa: E402
from kvscope.engine.sampling_params import SamplingParams  # noqa: E402
from kvscope.ui import panels  # noqa: E402
from kvscope.ui.live import HISTORY_STEPS, LiveFeed  # noqa: E402

ENGINE_THREAD = "kvscope-engine"
# Engine-thread telemetry entry points (module, class or None for a module function, name),
# of the code before pool deltas and after; those that exist are timed.
TELEMETRY_CALLS = (
    ("kvscope.engine.orchestrator.async_engine", "AsyncEngine", "_answer_snapshots"),
    ("kvscope.engine.orchestrator.async_engine", "AsyncEngine", "_publish_pool_delta"),
    ("kvscope.engine.orchestrator.async_engine", "AsyncEngine", "_send_pool_slices"),
    ("kvscope.engine.orchestrator.engine_core", "EngineCore", "_record"),
    ("kvscope.engine.telemetry.pool_recorder", "PoolRecorder", "record"),
)
IN_FLIGHT = 16
PREFIX_TOKENS = 32
PROMPT_TOKENS = 96
MAX_MODEL_LEN = 480
HISTORY_FILL_S = 60.0  # the longest wait for the step history to fill


class GcClock:
    """Every garbage collection while installed: (generation, start, end, thread)."""

    def __init__(self) -> None:
        self.collections: list[tuple[int, float, float, str, float]] = []
        self._started: dict[str, tuple[float, float]] = {}
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        thread, now, cpu = threading.current_thread().name, time.perf_counter(), time.thread_time()
        if phase == "start":
            self._started[thread] = now, cpu
        elif thread in self._started:
            started, started_cpu = self._started.pop(thread)
            self.collections.append((info["generation"], started, now, thread, cpu - started_cpu))

    def reset(self) -> None:
        self.collections = []

    def within(self, start: float, end: float) -> tuple[float, int | None]:
        """Seconds of [start, end] spent collecting, and the oldest generation collected."""
        spent, oldest = 0.0, None
        for generation, began, ended, *_ in list(self.collections):
            overlap = min(end, ended) - max(start, began)
            if overlap > 0:
                spent += overlap
                oldest = max(generation, oldest if oldest is not None else -1)
        return spent, oldest

    def report(self) -> dict:
        collections = list(self.collections)
        full = [c for c in collections if c[0] == 2]
        longest = max(full, key=lambda c: c[2] - c[1], default=None)
        on_engine = [c for c in full if c[3] == ENGINE_THREAD]
        return {
            "collections_per_generation": [sum(c[0] == g for c in collections)
                                           for g in range(3)],
            "full_max_ms": round(1e3 * (longest[2] - longest[1]), 1) if longest else 0.0,
            "full_max_thread": longest[3] if longest else None,
            "full_max_cpu_ms": round(1e3 * max((c[4] for c in full), default=0.0), 1),
            "engine_thread_full_collections": len(on_engine),
            "engine_thread_full_max_ms": round(1e3 * max(
                (c[2] - c[1] for c in on_engine), default=0.0), 2),
            "engine_thread_full_max_cpu_ms": round(1e3 * max(
                (c[4] for c in on_engine), default=0.0), 2),
            "objects_a_full_collection_walks": len(gc.get_objects()),  # frozen excluded
            "generation_2_objects": len(gc.get_objects(generation=2)),
            "frozen_objects": gc.get_freeze_count(),
        }


class TelemetryClock:
    """Wraps the engine's telemetry methods and sums their time on the engine thread."""

    def __init__(self) -> None:
        self.total = 0.0
        self.max_pause = 0.0
        self.max_pause_window = (0.0, 0.0)
        self.max_pause_cpu = 0.0
        self.lock = threading.Lock()
        for module_name, class_name, name in TELEMETRY_CALLS:
            owner = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            if hasattr(owner, name):
                setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if threading.current_thread().name != ENGINE_THREAD:
                return function(*args, **kwargs)
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                elapsed, cpu = ended - started, time.thread_time() - started_cpu
                with self.lock:
                    self.total += elapsed
                    self.max_pause_cpu = max(self.max_pause_cpu, cpu)
                    if elapsed > self.max_pause:
                        self.max_pause, self.max_pause_window = elapsed, (started, ended)
        return timed

    def reset(self) -> None:
        with self.lock:
            self.total = self.max_pause = self.max_pause_cpu = 0.0
            self.max_pause_window = (0.0, 0.0)


class Load:
    """Keeps IN_FLIGHT requests running (a finished one is replaced at once)."""

    def __init__(self, engine: AsyncEngine, vocab_size: int) -> None:
        self.engine, self.vocab_size = engine, vocab_size
        self.stopping = False
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(IN_FLIGHT)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping = True
        for thread in self.threads:
            thread.join()

    def _client(self, index: int) -> None:
        prefix = [3 + (7 * i) % (self.vocab_size - 3) for i in range(PREFIX_TOKENS)]
        turn = 0
        while not self.stopping:
            tail = [3 + (index * 131 + turn * 17 + 5 * i) % (self.vocab_size - 3)
                    for i in range(PROMPT_TOKENS - PREFIX_TOKENS)]
            stream = self.engine.submit(prefix + tail, SamplingParams(
                max_tokens=MAX_MODEL_LEN - PROMPT_TOKENS - 1, ignore_eos=True,
                temperature=1.0, seed=index * 1000 + turn))
            for _ in stream:
                if self.stopping:
                    stream.abort()
                    break
            turn += 1


def payload_bytes(values) -> int:
    """What gradio sends for the panel values (skipped panels send nothing)."""
    total = 0
    for value in values:
        if isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1:
            continue  # gr.skip()
        if hasattr(value, "to_json") or hasattr(value, "plot"):  # a figure, or its PlotData
            total += len(gr.Plot().postprocess(value).plot)
        elif isinstance(value, str):
            total += len(value)
    return total


def refresher(feed: LiveFeed):
    """The timer's handler for one tab: PanelRenderer.refresh (one render per change for
    all tabs, throttled by each panel's cost while busy), or before it refresh_panels."""
    if hasattr(panels, "PanelRenderer"):
        return panels.PanelRenderer(feed).refresh
    return functools.partial(panels.refresh_panels, feed)


def refresh(handler, shown):
    """(wall seconds, CPU seconds of this thread, payload bytes, the tab's signatures)."""
    started, started_cpu = time.perf_counter(), time.thread_time()
    *values, signatures = handler(shown)
    size = payload_bytes(values)  # serialising is part of the refresh's cost
    return time.perf_counter() - started, time.thread_time() - started_cpu, size, signatures


def measure(model: Path, num_blocks: int, refreshes: int) -> dict:
    clock, gc_clock = TelemetryClock.instance, GcClock.instance
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(model), dtype="float32", device="cpu", block_size=1,
        num_gpu_blocks_override=num_blocks, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512, device_memory_gb=4.0)).start()
    feed = LiveFeed(engine)
    load = Load(engine, engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size")
                else 64)
    try:
        load.start()
        # Every request admitted and decoding, and the dashboard's step history full.
        time.sleep(3.0)
        deadline = time.monotonic() + HISTORY_FILL_S
        while engine.counters().num_steps < HISTORY_STEPS and time.monotonic() < deadline:
            feed.refresh()
            time.sleep(1.0)
        clock.reset()
        gc_clock.reset()
        steps_before = engine.counters().num_steps
        tab = refresher(feed)
        first_s, _, first_bytes, shown = refresh(tab, None)
        load_s, load_cpu, load_bytes, every_s, every_cpu, every_bytes = [], [], [], [], [], []
        for _ in range(refreshes):
            time.sleep(1.0)
            seconds, cpu, size, shown = refresh(tab, shown)
            load_s.append(seconds)
            load_cpu.append(cpu)
            load_bytes.append(size)
            # Every panel built afresh (a new renderer, nothing cached or throttled).
            seconds, cpu, size, _ = refresh(refresher(feed), None)
            every_s.append(seconds)
            every_cpu.append(cpu)
            every_bytes.append(size)
        steps = engine.counters().num_steps - steps_before
        engine_total, engine_max, engine_max_cpu = clock.total, clock.max_pause, clock.max_pause_cpu
        pause_gc_s, pause_gc_generation = gc_clock.within(*clock.max_pause_window)
        gc_report = gc_clock.report()
        load.stop()
        time.sleep(0.5)
        refresh(tab, shown)  # the tab catches up with the end of the load
        idle_s, _, idle_bytes, _ = refresh(tab, refresh(tab, shown)[3])
        return {
            "num_blocks": num_blocks, "steps": steps,
            "engine_telemetry_ms_per_step": round(1e3 * engine_total / max(steps, 1), 3),
            "engine_max_pause_ms": round(1e3 * engine_max, 2),
            "engine_max_pause_gc_ms": round(1e3 * pause_gc_s, 2),
            "engine_max_pause_gc_generation": pause_gc_generation,
            "engine_max_pause_cpu_ms": round(1e3 * engine_max_cpu, 2),
            "gc": gc_report,
            "refresh_ms": {"new_tab": round(1e3 * first_s, 1),
                           "every_panel_under_load_mean": round(1e3 * statistics.mean(every_s), 1),
                           "every_panel_under_load_max": round(1e3 * max(every_s), 1),
                           "every_panel_under_load_cpu_mean": round(
                               1e3 * statistics.mean(every_cpu), 1),
                           "under_load_mean": round(1e3 * statistics.mean(load_s), 1),
                           "under_load_max": round(1e3 * max(load_s), 1),
                           "under_load_cpu_mean": round(1e3 * statistics.mean(load_cpu), 1),
                           "idle": round(1e3 * idle_s, 1)},
            "bytes": {"new_tab": first_bytes,
                      "every_panel_under_load_mean": round(statistics.mean(every_bytes)),
                      "under_load_mean": round(statistics.mean(load_bytes)),
                      "under_load_max": max(load_bytes), "idle": idle_bytes},
        }
    finally:
        load.stopping = True
        engine.shutdown()


def save_tiny_model(folder: Path) -> Path:
    """2 layers, hidden 32, 100 tokens: the engine's steps cost little beside telemetry."""
    return save_random_llama(folder, vocab_size=100, hidden_size=32, intermediate_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_positions=512)


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[3_000, 30_000, 100_000, 1_000_000])
    parser.add_argument("--refreshes", type=int, default=5,
                        help="refreshes under load per size, one a second")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    TelemetryClock.instance = TelemetryClock()
    GcClock.instance = GcClock()
    with tempfile.TemporaryDirectory() as folder:
        model = save_tiny_model(Path(folder))
        results = []
        for num_blocks in args.sizes:
            results.append(measure(model, num_blocks, args.refreshes))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
                      "in_flight": IN_FLIGHT, "block_size": 1, "results": results}, indent=1))


if __name__ == "__main__":
    main()
