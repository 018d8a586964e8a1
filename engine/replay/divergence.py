"""Where a simulated run's pool parts from a live run's of the same workload and config.

Both runs take the same scheduler, KV-cache manager and block pool through the same
requests; only the clock differs (measured live, the step-cost model's simulated). So step
by step the two agree until a request's arrival falls between different steps on the two
clocks, and from there every difference follows. `pool_divergence` lines the runs up by
step (blocks in use, running sequences, preemptions, prefix hits), and `first_divergence`
names the first step where what ran or what the pool held differs, and why: an admission
(the request, its arrival and where each clock stood), else a preemption, a prefix hit or
the blocks in use.
"""

import csv
import io
import math
from dataclasses import dataclass

from kvscope.engine.replay.metrics import RunResult
from kvscope.engine.telemetry.records import StepRecord

POOL_FIELDS = ("num_used_blocks", "num_running", "preemptions", "prefix_cache_hits")


def pool_state(record: StepRecord) -> tuple[int, int, int, int]:
    """POOL_FIELDS of one step."""
    return (record.num_used_blocks, record.num_running, len(record.preempted),
            record.prefix_cache_hits)


def ran(record: StepRecord) -> list[tuple[str, str, int, int]]:
    """What a step ran: (request, chunk kind, start, end) per chunk."""
    return [(request_id, kind, start, end) for request_id, _, kind, start, end in record.chunks]


def pool_divergence(live: RunResult, simulated: RunResult) -> list[dict]:
    """One row per step either run took: each run's POOL_FIELDS (None past its last
    step) and whether the step ran the same chunks and left the same pool."""
    rows = []
    for step in range(max(len(live.records), len(simulated.records))):
        pair = [run.records[step] if step < len(run.records) else None
                for run in (live, simulated)]
        row = {"step": step}
        for name, record in zip(("live", "simulated"), pair):
            state = pool_state(record) if record is not None else (None,) * len(POOL_FIELDS)
            row.update({f"{name}_{field}": value for field, value in zip(POOL_FIELDS, state)})
        row["same"] = None not in pair and ran(pair[0]) == ran(pair[1]) and \
            pool_state(pair[0]) == pool_state(pair[1])
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first step the runs part at, what differs there and its cause, in words."""

    step: int
    # "admission", "schedule", "preemptions", "prefix hits", "blocks in use" or
    # "running sequences"
    what: str
    cause: str


def first_divergence(live: RunResult, simulated: RunResult) -> Divergence | None:
    """None where every step agrees."""
    for row in pool_divergence(live, simulated):
        if not row["same"]:
            return _explain(row["step"], live, simulated)
    return None


def _explain(step: int, live: RunResult, simulated: RunResult) -> Divergence:
    runs = {"live": live, "simulated": simulated}
    ended = [name for name, run in runs.items() if step >= len(run.records)]
    if ended:
        return Divergence(step, "schedule", f"the {ended[0]} run ended after {step} steps")
    first = {name: _first_steps(run) for name, run in runs.items()}
    arrivals = {timing.request_id: timing.arrival_s for timing in live.requests}
    moved = sorted((request for request in first["live"].keys() | first["simulated"].keys()
                    if first["live"].get(request) != first["simulated"].get(request)
                    and min(first["live"].get(request, math.inf),
                            first["simulated"].get(request, math.inf)) <= step),
                   key=lambda request: (arrivals[request], request))
    if moved:  # the earliest arrival that ran first in different steps
        request = moved[0]
        arrival = arrivals[request]
        where = "; ".join(f"{name} ran it first in step {first[name].get(request)} (its "
                          f"clock {_clock_before(run, first[name].get(request))})"
                          for name, run in runs.items())
        return Divergence(step, "admission", f"request {request} arrived at {arrival:.4g} s; "
                          f"{where}: the clocks put its arrival between different steps")
    records = {name: run.records[step] for name, run in runs.items()}
    if ran(records["live"]) != ran(records["simulated"]):
        return Divergence(step, "schedule", "the same requests in other chunks: " + "; ".join(
            f"{name} ran {ran(record)}" for name, record in records.items()))
    # The same chunks ran, so the pools differ (pool_divergence found the step).
    states = {name: pool_state(record) for name, record in records.items()}
    what, index = next((what, index) for what, index in (
        ("preemptions", 2), ("prefix hits", 3), ("blocks in use", 0), ("running sequences", 1))
        if states["live"][index] != states["simulated"][index])
    return Divergence(step, what, f"live {states['live'][index]}, simulated "
                      f"{states['simulated'][index]}")


def _first_steps(run: RunResult) -> dict[str, int]:
    """Each request's first step that ran a chunk of it."""
    first: dict[str, int] = {}
    for index, record in enumerate(run.records):
        for request_id, *_ in record.chunks:
            first.setdefault(request_id, index)
    return first


def _clock_before(run: RunResult, step: int | None) -> str:
    """Where the run's clock stood when the loop admitted what `step` ran."""
    if step is None:
        return "never reached it"
    return f"{run.steps[step - 1].end_s:.4g} s" if step > 0 else "0 s"


def divergence_csv(pairs: list[tuple[RunResult, RunResult]]) -> str:
    """pool_divergence's rows for each (live, simulated) pair, the pair's run label first."""
    out = io.StringIO()
    writer = None
    for live, simulated in pairs:
        for row in pool_divergence(live, simulated):
            if writer is None:
                writer = csv.DictWriter(out, ["label", *row])
                writer.writeheader()
            writer.writerow({"label": simulated.label, **row})
    return out.getvalue()
