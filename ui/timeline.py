"""Figures over time, built from StepRecords: per-request Gantt, pool series, latencies."""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.telemetry import StepRecord
from ui.palette import PHASE_COLORS

MAX_TIMELINE_ROWS = 30


@dataclass(slots=True)
class Span:
    row: str
    phase: str
    start: float
    end: float
    label: str


@dataclass(slots=True)
class _SeqTrack:
    last_end: float | None = None
    decode_start: float | None = None
    decode_steps: list[int] = field(default_factory=list)
    preempted_at: float | None = None


def timeline_spans(records: Sequence[StepRecord],
                   arrivals: dict[str, float] | None = None) -> list[Span]:
    """Waiting, prefill chunk, decode run and preempted spans per sequence, in seconds."""
    arrivals = arrivals or {}
    spans: list[Span] = []
    tracks: dict[str, _SeqTrack] = {}

    def close_decode(seq_id: str, track: _SeqTrack) -> None:
        if track.decode_steps:
            first, last = track.decode_steps[0], track.decode_steps[-1]
            spans.append(Span(seq_id, "decode", track.decode_start, track.last_end,
                              f"{len(track.decode_steps)} decode steps ({first}–{last})"))
            track.decode_steps = []

    for record in records:
        for chunk in record.chunks:
            track = tracks.get(chunk.seq_id)
            if track is None:
                track = tracks[chunk.seq_id] = _SeqTrack()
                arrival = arrivals.get(chunk.request_id)
                if arrival is not None and arrival < record.start_time:
                    spans.append(Span(chunk.seq_id, "waiting", arrival, record.start_time,
                                      "waiting for a slot"))
            if track.preempted_at is not None:
                spans.append(Span(chunk.seq_id, "preempted", track.preempted_at,
                                  record.start_time, "preempted (blocks freed)"))
                track.preempted_at = None
            if chunk.kind == "decode":
                if not track.decode_steps or track.decode_steps[-1] != record.step - 1:
                    close_decode(chunk.seq_id, track)
                    track.decode_start = record.start_time
                track.decode_steps.append(record.step)
            else:
                close_decode(chunk.seq_id, track)
                spans.append(Span(chunk.seq_id, "prefill", record.start_time, record.end_time,
                                  f"step {record.step}: tokens [{chunk.start}, {chunk.end})"))
            track.last_end = record.end_time
        for seq_id in record.preempted:
            track = tracks.setdefault(seq_id, _SeqTrack())
            close_decode(seq_id, track)
            track.preempted_at = record.end_time
    if records:
        for seq_id, track in tracks.items():
            close_decode(seq_id, track)
            if track.preempted_at is not None:
                spans.append(Span(seq_id, "preempted", track.preempted_at,
                                  records[-1].end_time, "preempted (blocks freed)"))
    return spans


def request_timeline(records: Sequence[StepRecord],
                     arrivals: dict[str, float] | None = None) -> go.Figure:
    """A Gantt of the latest sequences: chunked prefills interleaving with decodes."""
    spans = timeline_spans(records, arrivals)
    first_start: dict[str, float] = {}
    for span in spans:
        first_start[span.row] = min(span.start, first_start.get(span.row, span.start))
    rows = sorted(first_start, key=first_start.get)[-MAX_TIMELINE_ROWS:]
    keep = set(rows)
    origin = min((span.start for span in spans), default=0.0)
    figure = go.Figure()
    for phase in ("waiting", "prefill", "decode", "preempted"):
        chosen = [s for s in spans if s.phase == phase and s.row in keep]
        figure.add_trace(go.Bar(
            name=phase, orientation="h", y=[s.row for s in chosen],
            base=[s.start - origin for s in chosen],
            x=[max(s.end - s.start, 1e-4) for s in chosen],
            marker_color=PHASE_COLORS[phase], customdata=[s.label for s in chosen],
            hovertemplate="%{y}: %{customdata}<br>%{base:.3f}s + %{x:.3f}s<extra></extra>"))
    finished = [(chunk.seq_id, record.end_time) for record in records
                for chunk in record.chunks if chunk.request_id in record.finished]
    finished = [(seq_id, t) for seq_id, t in finished if seq_id in keep]
    figure.add_trace(go.Scatter(
        name="finished", mode="markers", y=[s for s, _ in finished],
        x=[t - origin for _, t in finished], hovertemplate="%{y} finished<extra></extra>",
        marker={"symbol": "line-ns-open", "size": 14, "color": PHASE_COLORS["finished"]}))
    figure.update_layout(barmode="overlay", title=f"Request timelines ({len(rows)} latest "
                         "sequences)", height=180 + 22 * len(rows), xaxis_title="seconds",
                         margin={"l": 90, "r": 20, "t": 50, "b": 40}, uirevision="keep")
    # Category 0 sits at the bottom: reversed, the earliest sequence is the top row.
    figure.update_yaxes(type="category", categoryorder="array", categoryarray=rows[::-1])
    return figure


@dataclass(slots=True)
class LatencyStats:
    ttft: list[float]
    itl: list[float]
    output_tokens_per_s: float

    @staticmethod
    def percentile(values: list[float], q: int) -> float | None:
        if len(values) < 2:
            return values[0] if values else None
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latency_stats(records: Sequence[StepRecord],
                  arrivals: dict[str, float] | None = None) -> LatencyStats:
    """TTFT (needs arrival times) and inter-token latency, as seen in the step records.

    A sequence's first token comes out of the step that ran its last prefill chunk,
    i.e. the step just before its first decode (or the step it finished in).
    """
    arrivals = arrivals or {}
    last_prefill_end: dict[str, float] = {}
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    itl: list[float] = []
    for record in records:
        for chunk in record.chunks:
            seq = chunk.seq_id
            if chunk.kind == "prefill":
                last_prefill_end[seq] = record.end_time
                if chunk.request_id in record.finished:
                    first_token.setdefault(chunk.request_id, record.end_time)
                continue
            if chunk.request_id not in first_token and seq in last_prefill_end:
                first_token[chunk.request_id] = last_prefill_end[seq]
            # A forked sample's first token is its request's: it had no prefill of its own.
            previous = last_token.get(seq, first_token.get(chunk.request_id))
            if previous is not None:
                itl.append(record.end_time - previous)
            last_token[seq] = record.end_time
    ttft = [t - arrivals[r] for r, t in first_token.items() if r in arrivals]
    span = records[-1].end_time - records[0].start_time if records else 0.0
    generated = sum(record.num_generated_tokens for record in records)
    return LatencyStats(ttft, itl, generated / span if span > 0 else 0.0)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


def stats_markdown(stats: LatencyStats, hit_rate: float | None,
                   num_preemptions: int | None) -> str:
    def row(name: str, values: list[float]) -> str:
        cells = " | ".join(_ms(LatencyStats.percentile(values, q)) for q in (50, 90, 99))
        return f"| {name} | {cells} |"

    lines = ["| metric | p50 | p90 | p99 |", "|---|---|---|---|",
             row("time to first token", stats.ttft), row("inter-token latency", stats.itl),
             "", f"**output tokens/s** {stats.output_tokens_per_s:.1f}"]
    if hit_rate is not None:
        lines[-1] += f" · **prefix hit rate** {hit_rate:.0%}"
    if num_preemptions is not None:
        lines[-1] += f" · **preemptions** {num_preemptions}"
    return "\n".join(lines)


def pool_series(records: Sequence[StepRecord], num_blocks: int,
                token_usage: Sequence[tuple[float, float]] = ()) -> go.Figure:
    """KV usage (blocks, and tokens when sampled), queue lengths and throughput over time."""
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                           subplot_titles=("KV cache usage %", "sequences",
                                           "output tokens/s · preemptions"))
    origin = min([r.start_time for r in records[:1]] + [t for t, _ in token_usage[:1]],
                 default=0.0)
    times = [r.end_time - origin for r in records]
    blocks = [100 * r.num_used_blocks / max(num_blocks, 1) for r in records]
    figure.add_trace(go.Scatter(x=times, y=blocks, name="blocks in use"), 1, 1)
    if token_usage:
        figure.add_trace(go.Scatter(x=[t - origin for t, _ in token_usage],
                                    y=[100 * u for _, u in token_usage],
                                    name="token slots filled"), 1, 1)
    figure.add_trace(go.Scatter(x=times, y=[r.num_running for r in records],
                                name="running"), 2, 1)
    figure.add_trace(go.Scatter(x=times, y=[r.num_waiting for r in records],
                                name="waiting"), 2, 1)
    rate_times, rates = _throughput(records, origin)
    figure.add_trace(go.Scatter(x=rate_times, y=rates, name="output tokens/s"), 3, 1)
    preempted = [(t, len(r.preempted)) for t, r in zip(times, records) if r.preempted]
    figure.add_trace(go.Bar(x=[t for t, _ in preempted], y=[n for _, n in preempted],
                            name="preemptions", marker_color=PHASE_COLORS["preempted"]), 3, 1)
    figure.update_xaxes(title="seconds", row=3, col=1)
    figure.update_layout(height=520, margin={"l": 50, "r": 20, "t": 40, "b": 40},
                         uirevision="keep")
    return figure


def _throughput(records: Sequence[StepRecord], origin: float,
                window_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Generated tokens per second in consecutive windows (steps are too short to plot)."""
    buckets: dict[int, int] = {}
    for record in records:
        index = int((record.end_time - origin) // window_s)
        buckets[index] = buckets.get(index, 0) + record.num_generated_tokens
    ordered = sorted(buckets)
    return [(i + 0.5) * window_s for i in ordered], [buckets[i] / window_s for i in ordered]
