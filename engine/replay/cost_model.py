"""Step-cost models: how long one engine step takes, from what the step scheduled.

A step's time is modelled from three features of its StepRecord (what the scheduler
decided, so the simulator knows them before any forward):

    seconds = intercept + tokens(tokens scheduled) + per_decode * decode chunks
              + per_context_token * context read

where "context read" sums each chunk's end position (the K/V its attention reads) and
tokens() is piecewise linear: per_token up to the first knot, and past each knot the slope
changes by that knot's amount. A CPU engine's cost per scheduled row changes with the row
count where its linears change kernel (on the default model in fp32, a 16-row decode step
took less time than a 14-row one: the linears stream their weights for a few rows and run
oneDNN's GEMM past that, whose kernel changes with the rows again), so one straight line
fitted to a session's short steps predicted its longer ones too slow, and queueing in the
simulation multiplied that error on TTFT and TPOT (bench/replay.py;
docs/performance-history.md, 'A piecewise-linear cost model'). The knots sit on a grid of
row counts (powers of two and 1.5 times them) and are fitted only where at least
MIN_KNOT_STEPS steps fall on each side, so past the steps a model was fitted to its last
slope carries on.

The coefficients are fitted by least squares to the step records of real runs (a session
log's steps table, on this machine or a bigger one); a per_token, per_decode or
per_context_token that comes out negative is dropped and the rest refitted, and no step is
predicted faster than the fastest one fitted.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvscope.engine.replay.workload import SessionLogReader, is_session_log
from kvscope.engine.telemetry.records import StepRecord

FEATURES = ("per_token", "per_decode", "per_context_token")
KNOT_GRID = tuple(sorted({base * 2 ** p for p in range(14) for base in (2, 3)}))
MIN_KNOT_STEPS = 10


def step_features(record: StepRecord) -> tuple[int, int, int]:
    """(tokens scheduled, decode chunks, context read) of one step."""
    decodes = context = 0
    for _, _, kind, _, end in record.chunks:
        decodes += kind == "decode"
        context += end
    return record.num_scheduled_tokens, decodes, context


@dataclass(frozen=True, slots=True)
class StepCost:
    """The fitted model; step_time() is what the simulator's clock advances by."""

    intercept: float
    per_token: float
    per_decode: float
    per_context_token: float
    token_knots: tuple[tuple[int, float], ...] = ()  # (tokens, slope added past them)
    floor_seconds: float = 0.0  # the fastest step fitted: no prediction goes below it
    num_fit_steps: int = 0
    fit_error: float = 0.0  # mean absolute relative error on the steps it was fitted to

    def step_time(self, record: StepRecord) -> float:
        tokens, decodes, context = step_features(record)
        seconds = (self.intercept + self.per_token * tokens + self.per_decode * decodes
                   + self.per_context_token * context)
        for knot, slope in self.token_knots:
            if tokens <= knot:
                break
            seconds += slope * (tokens - knot)
        return max(seconds, self.floor_seconds)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StepCost":
        fields = json.loads(text)
        fields["token_knots"] = tuple(map(tuple, fields.get("token_knots", ())))
        return cls(**fields)


def fit_step_cost(records: Sequence[StepRecord], durations: Sequence[float] | None = None,
                  *, relative: bool = False) -> StepCost:
    """Least squares over steps that ran something. `durations` overrides the records'
    own (end - start), e.g. with a replay loop's step-to-step intervals. `relative` weighs
    each step by one over its time, so the fit minimizes relative errors: a calibration
    runs a few prefills a hundred times as long as its many decode steps, and absolute
    least squares would fit the prefills at the decodes' expense."""
    pairs = [(step_features(r), d) for r, d in zip(
        records, durations if durations is not None else [r.duration for r in records])
        if r.num_scheduled_tokens > 0]
    if len(pairs) < len(FEATURES) + 1:
        raise ValueError(f"cost model: {len(pairs)} steps that ran tokens; need at least "
                         f"{len(FEATURES) + 1} to fit (record a longer session)")
    x = np.array([features for features, _ in pairs], dtype=np.float64)
    y = np.array([duration for _, duration in pairs], dtype=np.float64)
    tokens = x[:, 0]
    knots = [k for k in KNOT_GRID if (tokens > k).sum() >= MIN_KNOT_STEPS
             and (tokens <= k).sum() >= MIN_KNOT_STEPS]
    hinges = np.column_stack([np.maximum(tokens - k, 0.0) for k in knots] or
                             [np.empty((len(y), 0))])
    weights = 1.0 / np.maximum(y, 1e-9) if relative else np.ones(len(y))
    kept = list(range(len(FEATURES)))
    while True:
        design = np.column_stack([np.ones(len(y)), x[:, kept], hinges])
        solution = np.linalg.lstsq(design * weights[:, None], y * weights, rcond=None)[0]
        negative = [k for k, value in zip(kept, solution[1:]) if value < 0]
        if not negative:
            break
        kept.remove(negative[0])
    coefficients = dict.fromkeys(FEATURES, 0.0)
    for k, value in zip(kept, solution[1:]):
        coefficients[FEATURES[k]] = float(value)
    slopes = solution[1 + len(kept):]
    predicted = np.maximum(design @ solution, y.min())
    error = float(np.mean(np.abs(predicted - y) / np.maximum(y, 1e-9)))
    return StepCost(max(float(solution[0]), 0.0), **coefficients,
                    token_knots=tuple((k, float(s)) for k, s in zip(knots, slopes)),
                    floor_seconds=float(y.min()), num_fit_steps=len(y), fit_error=error)


@dataclass(slots=True)
class RecordedStepTimes:
    """The step times of a recorded run, in order: replaying them makes the simulator's
    clock, and so every admission and allocation, follow that run exactly."""

    durations: list[float]
    _next: int = 0

    def step_time(self, record: StepRecord) -> float:
        if self._next >= len(self.durations):
            raise ValueError(f"recorded step times: the run took {len(self.durations)} "
                             "steps; the replay asked for more")
        self._next += 1
        return self.durations[self._next - 1]


@dataclass(frozen=True, slots=True)
class CostModelSource:
    """Where a simulation's step-cost model came from: the report names it."""

    # "session log", "saved model", "recorded steps" (the source log's own) or
    # "self-calibration"
    kind: str
    path: str  # the log or JSON given, or the self-calibration's cache file
    num_steps: int  # the steps it was fitted to
    fit_error: float  # their mean absolute relative error
    made_at: str | None = None  # a self-calibration: when it ran (UTC, ISO 8601)
    calibration_s: float | None = None  # and how long it took
    reused: bool = False  # read back from the cache, not profiled by this command

    def describe(self) -> str:
        text = (f"{self.kind} {self.path}: {self.num_steps} steps, fit error "
                f"{100 * self.fit_error:.1f} %")
        if self.made_at is not None:
            text += (f", made {self.made_at} in {self.calibration_s:.1f} s"
                     + (" (reused from the cache)" if self.reused else ""))
        return text


def load_step_cost(path: str | Path, session_logs: SessionLogReader) -> StepCost:
    """A model saved as JSON, or fitted to the steps of a session log's latest session
    that has any."""
    path = Path(path)
    if is_session_log(path):
        return fit_step_cost(session_logs.load_logged_steps(path))
    try:
        return StepCost.from_json(path.read_text())
    except (OSError, json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"cost_model={str(path)!r}: not a session log or a saved model "
                         f"({error})") from None
