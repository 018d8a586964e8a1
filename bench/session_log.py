"""The SQLite session log under a GPU-scale load: can its writer keep up with 1,000
steps a second, and what does exporting a long session cost in memory?

- writer: step records of 16 running sequences (16 decode chunks each) enqueued at a
  fixed rate for a few seconds; reported: rows written per second of the run, rows
  dropped (queue full), and how long the final flush waited after the last record;
- burst: as many records as fast as possible, then the time to commit them all (the
  writer's ceiling);
- export: a session of --export-steps steps in each format: seconds, file size, and the
  peak of Python allocations while exporting (tracemalloc).

Usage:
  flock /work/bench.lock .venv/bin/python bench/session_log.py
"""

import argparse
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvscope.engine.telemetry.records import StepRecord  # noqa: E402
from kvscope.storage import SessionLog  # noqa: E402

RUNNING = 16


def step_record(step: int) -> StepRecord:
    now = time.time()
    chunks = tuple((f"req-{i}", f"req-{i}", "decode", 100 + step, 101 + step)
                   for i in range(RUNNING))
    return StepRecord(step=step, start_time=now, end_time=now + 0.001, chunks=chunks,
                      preempted=(), swapped_out=(), swapped_in=(), finished=(),
                      num_scheduled_tokens=RUNNING, token_budget=2048,
                      num_used_blocks=90_000, num_cached_blocks=5_000,
                      num_free_blocks=5_000, num_running=RUNNING, num_waiting=0,
                      num_generated_tokens=RUNNING)


def paced(folder: Path, rate: float, seconds: float) -> dict:
    log = SessionLog(folder / "paced.db")
    log.start_session({}, "bench")
    count = int(rate * seconds)
    started = time.perf_counter()
    for step in range(count):
        delay = started + step / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        log.record_step(step_record(step))
    enqueued = time.perf_counter()
    log.flush(timeout=120)
    done = time.perf_counter()
    result = {"steps_per_s_asked": rate, "steps": count,
              "written_per_s": round(log.num_written / (done - started)),
              "dropped": log.num_dropped, "flush_after_last_s": round(done - enqueued, 3)}
    log.close()
    return result


def burst(folder: Path, count: int) -> dict:
    log = SessionLog(folder / "burst.db")
    session_id = log.start_session({}, "bench")
    started = time.perf_counter()
    for step in range(count):
        log.record_step(step_record(step))
    log.flush(timeout=300)
    seconds = time.perf_counter() - started
    result = {"steps": count, "seconds": round(seconds, 2),
              "written_per_s": round(log.num_written / seconds), "dropped": log.num_dropped}
    return result, log, session_id


def export(log: SessionLog, session_id: int, folder: Path) -> dict:
    results = {}
    for fmt in ("json", "csv", "sqlite"):
        tracemalloc.start()
        started = time.perf_counter()
        path = log.export(session_id, fmt, folder / "exports")
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        results[fmt] = {"seconds": round(seconds, 2), "file_mb": round(path.stat().st_size / 2**20, 1),
                        "peak_python_mb": round(peak / 2**20, 1)}
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="steps per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--export-steps", type=int, default=50_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        paced_result = paced(folder, args.rate, args.seconds)
        burst_result, log, session_id = burst(folder, args.export_steps)
        export_result = export(log, session_id, folder)
        log.close()
    print(json.dumps({"cores": os.cpu_count(), "paced": paced_result, "burst": burst_result,
                      "export": export_result}, indent=1))


if __name__ == "__main__":
    main()
