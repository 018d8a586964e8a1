"""Figures over time, built from StepRecords: per-request Gantt, pool series, latencies.

Both figures put the wall clock on x, so one moment reads the same on each."""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui.events import preemption_words
from kvscope.ui.palette import PHASE_COLORS, SERIES_COLORS
from kvscope.ui.plotdata import TITLE, Figure, epoch_ms, of_request, placeholder

MAX_TIMELINE_ROWS = 30
WINDOW_S = 120.0  # the live panels' rolling window
NEW_RUN_GAP_S = 10.0  # after a pause this long the window starts at the new run
RUN_MARGIN_S = 2.0
IDLE_GAP_S = 2.0  # steps further apart than this are an idle period: the lines break
# A marker shape per preemption reason (engine.core.kv_events.PreemptionReason), and one
# for the preemptions of a log older than schema 9, which kept no reasons.
UNRECORDED = "reason not recorded"
PREEMPTION_SYMBOLS = {"kv_full": "triangle-down", "priority": "star", "max_num_seqs": "square",
                      UNRECORDED: "triangle-down-open"}
USAGE_GAP_S = 5.0  # token usage is sampled once a refresh; a closed tab leaves gaps
THROUGHPUT_BUCKET_S = 1.0
RATE_WINDOW_S = 10.0  # the stats line's rolling output rate
MAX_SERIES_POINTS = 600  # per line of the usage series; a wide chart is ~1,000 pixels


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
    preempted_why: str = "preempted (blocks freed)"


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
        for request_id, seq_id, kind, start, end in record.chunks:
            track = tracks.get(seq_id)
            if track is None:
                track = tracks[seq_id] = _SeqTrack()
                arrival = arrivals.get(request_id)
                if arrival is not None and arrival < record.start_time:
                    spans.append(Span(seq_id, "waiting", arrival, record.start_time,
                                      "waiting for a slot"))
            if track.preempted_at is not None:
                spans.append(Span(seq_id, "preempted", track.preempted_at,
                                  record.start_time, track.preempted_why))
                track.preempted_at = None
            if kind == "decode":
                if not track.decode_steps or track.decode_steps[-1] != record.step - 1:
                    close_decode(seq_id, track)
                    track.decode_start = record.start_time
                track.decode_steps.append(record.step)
            else:
                close_decode(seq_id, track)
                spans.append(Span(seq_id, "prefill", record.start_time, record.end_time,
                                  f"step {record.step}: tokens [{start}, {end})"))
            track.last_end = record.end_time
        causes = {cause[0]: cause for cause in record.preemptions}
        for seq_id in record.preempted:
            track = tracks.setdefault(seq_id, _SeqTrack())
            close_decode(seq_id, track)
            track.preempted_at = record.end_time
            if seq_id in causes:  # a log older than schema 9 kept no causes
                track.preempted_why = "preempted " + preemption_words(
                    causes[seq_id], set(record.swapped_out))
    if records:
        for seq_id, track in tracks.items():
            close_decode(seq_id, track)
            if track.preempted_at is not None:
                spans.append(Span(seq_id, "preempted", track.preempted_at,
                                  records[-1].end_time, track.preempted_why))
    return spans


def live_window(records: Sequence[StepRecord], now: float) -> tuple[float, float]:
    """The live panels' shared x range: the last WINDOW_S seconds, or less, from the start
    of the latest run (the steps since the last pause of NEW_RUN_GAP_S), so a new run
    fills the width instead of its last few percent."""
    start = now - WINDOW_S
    run_start = None
    for record in reversed(records):
        if run_start is not None and run_start - record.end_time > NEW_RUN_GAP_S:
            break
        if record.end_time < start:  # the run is longer than the window
            return start, now
        run_start = record.start_time
    if run_start is None:
        return start, now
    return max(start, run_start - RUN_MARGIN_S), now


def in_window(records: Sequence[StepRecord],
              window: tuple[float, float] | None) -> Sequence[StepRecord]:
    if window is None:
        return records
    first = next((i for i in range(len(records) - 1, -1, -1)
                  if records[i].end_time < window[0]), -1)
    return records[first + 1:]


def _date_axis(window: tuple[float, float] | None, **extra) -> dict:
    axis = {"type": "date", "title": {"text": "time"}, "tickformat": "%H:%M:%S",
            "hoverformat": "%H:%M:%S.%L", **extra}
    if window is not None:
        axis["range"] = [epoch_ms(window[0]), epoch_ms(window[1])]
    return axis


def request_timeline(records: Sequence[StepRecord], arrivals: dict[str, float] | None = None,
                     window: tuple[float, float] | None = None, follow: str = "") -> Figure:
    """A Gantt of the latest sequences on the wall clock: chunked prefills interleaving
    with decodes. `window` (start, end) in seconds clips it to the live view; the followed
    request's rows (`follow`, a request id) are marked ▶ where they start."""
    records = in_window(records, window)
    spans = timeline_spans(records, arrivals)
    if not spans:
        return placeholder("Request timelines", "No requests in this window yet: send a chat "
                           "message or start the load generator.")
    first_start: dict[str, float] = {}
    for span in spans:
        first_start[span.row] = min(span.start, first_start.get(span.row, span.start))
    rows = sorted(first_start, key=first_start.get)[-MAX_TIMELINE_ROWS:]
    keep = set(rows)
    data = []
    for phase in ("waiting", "prefill", "decode", "preempted"):
        chosen = [s for s in spans if s.phase == phase and s.row in keep]
        data.append({
            "type": "bar", "name": phase, "orientation": "h", "y": [s.row for s in chosen],
            "base": [epoch_ms(s.start) for s in chosen],
            "x": [max(round((s.end - s.start) * 1000, 1), 0.1) for s in chosen],
            "marker": {"color": PHASE_COLORS[phase]}, "customdata": [s.label for s in chosen],
            "hovertemplate": "%{y}: %{customdata}<br>%{x:.0f} ms<extra></extra>"})
    finished = [(seq_id, record.end_time) for record in records
                for request_id, seq_id, *_ in record.chunks if request_id in record.finished]
    finished = [(seq_id, t) for seq_id, t in finished if seq_id in keep]
    data.append({
        "type": "scatter", "name": "finished", "mode": "markers",
        "y": [s for s, _ in finished], "x": [epoch_ms(t) for _, t in finished],
        "hovertemplate": "%{y} finished<extra></extra>",
        "marker": {"symbol": "line-ns-open", "size": 14, "color": PHASE_COLORS["finished"]}})
    marks = speculation_marks(records, keep)
    if marks is not None:
        data.append(marks)
    followed = [row for row in rows if of_request(row, follow)]
    if followed:
        data.append({"type": "scatter", "name": f"following {follow}", "mode": "markers",
                     "y": followed, "x": [epoch_ms(first_start[row]) for row in followed],
                     "marker": {"symbol": "triangle-right", "size": 12, "color": "#111827"},
                     "hovertemplate": "%{y}: followed<extra></extra>"})
    title = f"Request timelines: {len(rows)} latest sequences"
    left_out = len(first_start) - len(rows)
    if left_out:
        title = (f"Request timelines: {len(rows)} latest of {len(first_start)} sequences"
                 f"<br><sup>{left_out} earlier in this window not drawn</sup>")
    return {"data": data, "layout": {
        # The title at the top, the legend under it on the left: side by side they met
        # at narrow widths.
        "barmode": "overlay", "title": TITLE | {"text": title},
        "height": 220 + 22 * len(rows), "margin": {"l": 90, "r": 20, "t": 100, "b": 40},
        "uirevision": "keep", "xaxis": _date_axis(window),
        # Category 0 sits at the bottom: reversed, the earliest sequence is the top row.
        "yaxis": {"type": "category", "categoryorder": "array", "categoryarray": rows[::-1]},
        "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0}}}


# A verifying step's mark: every proposal accepted, some, or none.
SPEC_MARK_COLORS = {"all": "#16a34a", "some": "#f59e0b", "none": "#dc2626"}


def speculation_marks(records: Sequence[StepRecord], rows: set[str]) -> dict | None:
    """Speculative decoding on the timeline: a mark on a sequence's row at the end of each
    step that verified its proposals, saying how many tokens it proposed, accepted and
    rejected (None: no proposals among these rows)."""
    y, x, colors, labels = [], [], [], []
    for record in records:
        for seq_id, proposed, accepted in record.spec_drafts:
            if seq_id not in rows:
                continue
            y.append(seq_id)
            x.append(epoch_ms(record.end_time))
            share = "all" if accepted == proposed else "some" if accepted else "none"
            colors.append(SPEC_MARK_COLORS[share])
            labels.append(f"step {record.step}: {proposed} proposed, {accepted} accepted, "
                          f"{proposed - accepted} rejected")
    if not y:
        return None
    return {"type": "scatter", "name": "speculation", "mode": "markers", "y": y, "x": x,
            "customdata": labels, "hovertemplate": "%{y}: %{customdata}<extra></extra>",
            "marker": {"symbol": "diamond", "size": 7, "color": colors}}


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
        for request_id, seq, kind, _, _ in record.chunks:
            if kind == "prefill":
                last_prefill_end[seq] = record.end_time
                if request_id in record.finished:
                    first_token.setdefault(request_id, record.end_time)
                continue
            if request_id not in first_token and seq in last_prefill_end:
                first_token[request_id] = last_prefill_end[seq]
            # A forked sample's first token is its request's: it had no prefill of its own.
            previous = last_token.get(seq, first_token.get(request_id))
            if previous is not None:
                itl.append(record.end_time - previous)
            last_token[seq] = record.end_time
    ttft = [t - arrivals[r] for r, t in first_token.items() if r in arrivals]
    span = records[-1].end_time - records[0].start_time if records else 0.0
    generated = sum(record.num_generated_tokens for record in records)
    return LatencyStats(ttft, itl, generated / span if span > 0 else 0.0)


def recent_output_rate(records: Sequence[StepRecord], now: float,
                       seconds: float = RATE_WINDOW_S) -> float:
    """Output tokens per second over the last `seconds` (idle time counts as idle)."""
    generated = 0
    for record in reversed(records):
        if record.end_time < now - seconds:
            break
        generated += record.num_generated_tokens
    return generated / seconds


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


@dataclass(frozen=True, slots=True)
class HitRates:
    """Prompt tokens found in the prefix cache, of those looked up: counted by the pool
    since it was built (a reconfigure starts a new one) and, as /metrics counts them,
    since the engine started."""

    pool_hits: int
    pool_queries: int
    total_hits: int
    total_queries: int

    def describe(self) -> str:
        def rate(hits: int, queries: int) -> str:
            return f"{hits / queries:.0%}" if queries else "–"

        line = (f"**prefix hit rate** {rate(self.pool_hits, self.pool_queries)} of "
                f"{self.pool_queries} prompt tokens since the pool was built")
        if (self.pool_hits, self.pool_queries) != (self.total_hits, self.total_queries):
            line += (f" ({rate(self.total_hits, self.total_queries)} of "
                     f"{self.total_queries} since the engine started, as /metrics' "
                     "prefix_cache_hits / prefix_cache_queries count)")
        return line


def stats_markdown(stats: LatencyStats, hit_rates: HitRates | None,
                   num_preemptions: int | None, rate: tuple[str, float]) -> str:
    """The percentile table and one line of totals; `rate` is (its label, tokens/s)."""
    def row(name: str, values: list[float]) -> str:
        cells = " | ".join(_ms(LatencyStats.percentile(values, q)) for q in (50, 90, 99))
        return f"| {name} | {cells} |"

    label, value = rate
    lines = ["| metric | p50 | p90 | p99 |", "|---|---|---|---|",
             row("time to first token", stats.ttft), row("inter-token latency", stats.itl),
             "", f"**output tokens/s** ({label}) {value:.1f}"]
    if hit_rates is not None:
        lines[-1] += f" · {hit_rates.describe()}"
    if num_preemptions is not None:
        lines[-1] += f" · **preemptions** {num_preemptions}" + (
            " since the pool was built" if hit_rates is not None else "")
    return "\n".join(lines)


def _with_breaks(times: list[float], values: list[float | None], gap_s: float,
                 starts: list[float] | None = None) -> tuple[list[float], list[float | None]]:
    """Insert a gap point wherever more than gap_s passed between one sample and the start
    of the next (a step's start: a long step is work, not idleness), so a line stops at
    an idle period instead of sliding across it."""
    starts = starts or times
    xs: list[float] = []
    ys: list[float | None] = []
    for index, (t, value) in enumerate(zip(times, values)):
        if index and starts[index] - times[index - 1] > gap_s:
            xs.append(epoch_ms((t + times[index - 1]) / 2))
            ys.append(None)
        xs.append(epoch_ms(t))
        ys.append(value)
    return xs, ys


def _thinned(xs: list[float], ys: list[float | None],
             max_points: int = MAX_SERIES_POINTS) -> tuple[list[float], list[float | None]]:
    """At most about max_points of a line (a full step history is 3,000 points per trace,
    more than a chart has pixels for, and most of a refresh's bytes): each stretch of
    consecutive samples keeps its lowest and its highest, in time order, so no spike
    disappears; breaks (None) and the last sample stay."""
    if len(xs) <= max_points:
        return xs, ys
    stretch = -(-len(xs) // (max_points // 2))
    kept: list[int] = []
    for begin in range(0, len(xs), stretch):
        indices = range(begin, min(begin + stretch, len(xs)))
        samples = [i for i in indices if ys[i] is not None]
        chosen = {i for i in indices if ys[i] is None}
        if samples:
            chosen.update((min(samples, key=ys.__getitem__), max(samples, key=ys.__getitem__)))
        kept.extend(sorted(chosen))
    if kept[-1] != len(xs) - 1:
        kept.append(len(xs) - 1)
    return [xs[i] for i in kept], [ys[i] for i in kept]


def pool_series(records: Sequence[StepRecord],
                usage_samples: Sequence[tuple[float, float, float]] = (),
                window: tuple[float, float] | None = None) -> Figure:
    """KV usage (live: blocks in use and token slots filled, read together off each
    refresh's snapshot; a saved session: the steps' block counts), queue lengths,
    throughput and preemptions on the wall clock. Usage is against each step's own pool, so a
    reconfigure does not rescale the past."""
    records = in_window(records, window)
    if window is not None:
        usage_samples = [sample for sample in usage_samples if sample[0] >= window[0]]
    if not records:
        return placeholder("KV usage, queues, throughput", "No engine steps in this window "
                           "yet: the series start with the first request.")
    times = [r.end_time for r in records]
    starts = [r.start_time for r in records]

    def step_line(values, name: str, axis: str, samples=None, gap_s=IDLE_GAP_S) -> dict:
        xs, ys = _thinned(*_with_breaks(samples or times, values, gap_s,
                                        None if samples else starts))
        # Markers too: a lone sample between two breaks would draw nothing as a line.
        return {"type": "scatter", "mode": "lines+markers",
                "line": {"shape": "hv", "color": SERIES_COLORS[name]},
                "marker": {"size": 3, "color": SERIES_COLORS[name]}, "x": xs, "y": ys,
                "name": name, "yaxis": axis,
                "connectgaps": False}

    if usage_samples:  # both lines from the same snapshots: tokens never above blocks
        at = [t for t, _, _ in usage_samples]
        data = [step_line([round(100 * b, 2) for _, b, _ in usage_samples], "blocks in use",
                          "y", samples=at, gap_s=USAGE_GAP_S),
                step_line([round(100 * u, 2) for _, _, u in usage_samples],
                          "token slots filled", "y", samples=at, gap_s=USAGE_GAP_S)]
    else:  # a saved session: the steps' own block counts
        data = [step_line([round(100 * r.num_used_blocks
                                 / max(r.num_used_blocks + r.num_cached_blocks
                                       + r.num_free_blocks, 1), 2) for r in records],
                          "blocks in use", "y")]
    data.append(step_line([r.num_running for r in records], "running", "y2"))
    data.append(step_line([r.num_waiting for r in records], "waiting", "y2"))
    rate_times, rates = _throughput(records)
    data.append(step_line(rates, "output tokens/s", "y3", samples=rate_times,
                          gap_s=THROUGHPUT_BUCKET_S * 1.5))
    for reason, symbol in PREEMPTION_SYMBOLS.items():  # one marker shape per reason
        preempted = [(r.end_time, n) for r in records
                     if (n := sum(cause[1] == reason for cause in r.preemptions)
                         if r.preemptions else len(r.preempted) * (reason == UNRECORDED))]
        if preempted:
            data.append({
                "type": "scatter", "mode": "markers", "name": f"preemptions: {reason}",
                "yaxis": "y4", "x": [epoch_ms(t) for t, _ in preempted],
                "y": [n for _, n in preempted],
                "marker": {"symbol": symbol, "size": 10, "color": PHASE_COLORS["preempted"]},
                "hovertemplate": f"%{{y}} preempted ({reason})<extra></extra>"})
    titles = [("KV cache usage %", 1.0), ("sequences", 0.64),
              ("output tokens/s (left) · preemptions per step by reason (right: ▼ kv_full, "
               "★ priority, ■ max_num_seqs)", 0.28)]
    return {"data": data, "layout": {
        "height": 560, "margin": {"l": 50, "r": 50, "t": 40, "b": 110}, "uirevision": "keep",
        "xaxis": _date_axis(window, anchor="y3"),
        # From 0 up to what was reached: a chat's few blocks of a large pool are a line
        # one can read, not flat against a fixed 0-100. (Plotly's autorangeoptions'
        # maxallowed pinned the axis at its maximum, so the range is left to autorange.)
        "yaxis": {"domain": [0.72, 1.0], "rangemode": "tozero"},
        "yaxis2": {"domain": [0.36, 0.64], "rangemode": "tozero"},
        "yaxis3": {"domain": [0.0, 0.28], "rangemode": "tozero"},
        "yaxis4": {"overlaying": "y3", "side": "right", "rangemode": "tozero",
                   "showgrid": False, "dtick": 1,
                   "tickfont": {"color": PHASE_COLORS["preempted"]}},
        "annotations": [{"text": text, "x": 0, "y": y, "xref": "paper", "yref": "paper",
                         "xanchor": "left", "yanchor": "bottom", "showarrow": False}
                        for text, y in titles],
        # Below the time axis' title, not over it.
        "legend": {"orientation": "h", "y": -0.2, "yanchor": "top"}}}


def _throughput(records: Sequence[StepRecord]) -> tuple[list[float], list[float]]:
    """Generated tokens per second in consecutive buckets (steps are too short to plot),
    zero for buckets inside a run with no step."""
    if not records:
        return [], []
    bucket = THROUGHPUT_BUCKET_S
    origin = records[0].end_time
    counts: dict[int, int] = {}
    for record in records:
        index = int((record.end_time - origin) // bucket)
        counts[index] = counts.get(index, 0) + record.num_generated_tokens
    times, rates = [], []
    previous = None
    for index in sorted(counts):
        if previous is not None and (index - previous) * bucket <= IDLE_GAP_S:
            for empty in range(previous + 1, index):  # a short pause inside a run
                times.append(origin + (empty + 1) * bucket)
                rates.append(0.0)
        times.append(origin + (index + 1) * bucket)
        rates.append(counts[index] / bucket)
        previous = index
    return times, rates
