"""A replay run's timings and series, and their summary (the keys of `--json`).

Times are seconds on the replay's clock, from the workload's first arrival: real seconds in
a live run (less the oversleep of idle waits), modelled seconds in a simulated one.
"""

from dataclasses import asdict, dataclass, field

import numpy as np

from kvscope.engine.replay.cost_model import CostModelSource
from kvscope.engine.telemetry.records import StepRecord

# At most this many points of a run's KV-usage series go into its JSON summary.
MAX_SERIES_POINTS = 500


@dataclass(slots=True)
class RequestTiming:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finished_s: float | None = None
    num_output_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # the first sample's

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None with one token)."""
        if self.finished_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class StepSample:
    """What a replay keeps of one step: when it ended, how long it took, the pool."""

    end_s: float
    duration_s: float
    kv_usage: float  # used blocks / blocks
    num_preempted: int
    num_blocks_swapped_out: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_used_blocks: int


@dataclass(slots=True)
class RunResult:
    """One run of a workload under one config."""

    label: str
    config: dict  # the knobs this run changed
    mode: str  # "live" or "simulated"
    num_blocks: int
    requests: list[RequestTiming]
    steps: list[StepSample]
    records: list[StepRecord]  # the engine's own, for fitting cost models and checks
    wall_s: float
    cost_model: CostModelSource | None = None  # where a simulated run's step times came from

    def summary(self) -> dict:
        ttft = [r.ttft_s for r in self.requests if r.ttft_s is not None]
        tpot = [r.tpot_s for r in self.requests if r.tpot_s is not None]
        end = max((r.finished_s or 0.0) for r in self.requests)
        tokens = sum(r.num_output_tokens for r in self.requests)
        queries = sum(s.prefix_cache_queries for s in self.steps)
        usage = np.array([s.kv_usage for s in self.steps] or [0.0])
        weights = np.array([s.duration_s for s in self.steps] or [1.0])
        return {
            "label": self.label, "config": self.config, "mode": self.mode,
            "num_requests": len(self.requests), "num_steps": len(self.steps),
            "num_blocks": self.num_blocks, "num_output_tokens": tokens,
            "throughput_tok_s": tokens / end if end > 0 else 0.0,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_s": _percentile(tpot, 50),
            "preemptions": sum(s.num_preempted for s in self.steps),
            "swapped_blocks": sum(s.num_blocks_swapped_out for s in self.steps),
            "prefix_hit_rate": (sum(s.prefix_cache_hits for s in self.steps) / queries
                                if queries else 0.0),
            "peak_kv_usage": float(usage.max()),
            "mean_kv_usage": float(np.average(usage, weights=weights)
                                   if weights.sum() > 0 else usage.mean()),
            "makespan_s": end, "wall_s": self.wall_s,
            "kv_usage": self.kv_usage_series(MAX_SERIES_POINTS),
            "cost_model": None if self.cost_model is None else {
                **asdict(self.cost_model), "description": self.cost_model.describe()},
        }

    def kv_usage_series(self, max_points: int | None = None) -> list[list[float]]:
        """[[seconds, used blocks / blocks], ...] after each step (every k-th step when
        there are more than max_points, the peak step always kept)."""
        points = [[s.end_s, s.kv_usage] for s in self.steps]
        if max_points is None or len(points) <= max_points:
            return points
        stride = -(-len(points) // max_points)
        peak = max(range(len(points)), key=lambda i: points[i][1])
        return [p for i, p in enumerate(points) if i % stride == 0 or i == peak]

    def latencies(self, name: str) -> list[float]:
        """Every request's ttft_s or tpot_s that exists, sorted (for CDFs)."""
        return sorted(v for r in self.requests if (v := getattr(r, name)) is not None)


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
