"""The live panels' handler: every panel rendered once per change for all tabs, and no
more often than its cost allows while the engine is busy."""

import itertools
import threading
import time
from dataclasses import dataclass

import gradio as gr
from markdown_it import MarkdownIt

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.ui import figures, spec_decode, timeline
from kvscope.ui.live import LiveFeed, LiveState
from kvscope.ui.plotdata import placeholder, to_plot

PANELS = ("summary", "heatmap", "block_tables", "prefix_tree", "timeline", "series", "stats",
          "comparison", "spec_decode")
# Each panel's element (the summary line sits above the tabs and is always sent).
PANEL_ELEMENTS = {name: f"kv-{name.replace('_', '-')}" for name in PANELS[1:]}
REFRESH_S = 1.0
# While the engine is busy a panel may use this share of one core: a panel that takes
# 30 ms to build refreshes every second, one that takes 200 ms every 6.7 s. The engine
# shares the process (and its GIL) with these builders.
PANEL_DUTY = 0.03
MAX_INTERVAL_S = 8.0
# Timer ticks jitter; without slack a 1 s panel would land on every other tick.
TICK_SLACK_S = 0.2
COST_SMOOTHING = 0.3
# The summary and stats lines as HTML made here: the browser's poller (ui/live_poller.js)
# puts them in place without Gradio's Markdown renderer. Raw HTML in the text stays text.
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
TEXT_PANELS = ("summary", "stats")


@dataclass(frozen=True, slots=True)
class PanelViews:
    """What a tab chose to look at: the heatmap's range and the block tables' page."""

    heatmap_view: str = "whole pool"
    heatmap_start: int | None = None
    heatmap_stop: int | None = None
    tables: figures.TableView = figures.TableView()

    def of(self, name: str) -> object:
        """The part of the view a panel depends on (None: it has no view)."""
        if name == "heatmap":
            return self.heatmap_view, self.heatmap_start, self.heatmap_stop
        return self.tables if name == "block_tables" else None


def panel_views(heatmap_view=None, heatmap_start=None, heatmap_stop=None, table_order=None,
                table_page=None, table_filter=None) -> PanelViews:
    """The views from the controls' raw values (None or blank = the default)."""
    return PanelViews(
        heatmap_view or "whole pool",
        None if heatmap_start in (None, "") else int(heatmap_start),
        None if heatmap_stop in (None, "", 0) else int(heatmap_stop),  # 0: to the end
        figures.TableView(table_order or "most recent", max(int(table_page or 1), 1),
                          (table_filter or "").strip()))


def _signatures(state: LiveState) -> dict[str, object]:
    snapshot = state.snapshot
    # The mirror counts its own changes, so an unchanged pool costs nothing to notice.
    pool = (snapshot.epoch, snapshot.blocks_version, snapshot.ready)
    sequences = (snapshot.epoch, snapshot.sequences_version)
    last = state.records[-1] if state.records else None
    last_step = last.step if last else -1
    # The rolling rate keeps falling after the last step, until its window has passed.
    rate_clock = (int(state.now) if last and state.now - last.end_time
                  < timeline.RATE_WINDOW_S + 1 else None)
    return {
        "summary": (snapshot.num_blocks, snapshot.block_size, snapshot.num_running,
                    snapshot.num_waiting, hash(str(snapshot.config))),
        "heatmap": (pool, sequences),  # hover names the owners
        "block_tables": (pool, sequences),
        "prefix_tree": pool,
        "timeline": (last_step, len(state.arrivals)),
        "series": (last_step, snapshot.num_used_tokens),
        "stats": (last_step, snapshot.prefix_cache_hits, snapshot.num_preemptions, rate_clock),
        "comparison": (pool, sequences),
        "spec_decode": last_step,
    }


def summary_markdown(snapshot: PoolMirror) -> str:
    config = snapshot.config
    max_model_len = config.get("max_model_len") or 0
    per_sequence = -(-max_model_len // snapshot.block_size) if max_model_len else 0
    concurrency = snapshot.num_blocks / per_sequence if per_sequence else 0
    return (f"**pool** {snapshot.num_blocks} blocks x {snapshot.block_size} tokens = "
            f"{snapshot.num_blocks * snapshot.block_size} token slots · **max concurrency** "
            f"{concurrency:.1f} x {max_model_len} tokens · **running** {snapshot.num_running}"
            f" · **waiting** {snapshot.num_waiting} · prefix caching "
            f"{'on' if config.get('enable_prefix_caching') else 'off'} · chunked prefill "
            f"{'on' if config.get('enable_chunked_prefill') else 'off'}")


def text_html(markdown: str) -> str:
    """A text panel's HTML, in the wrapper the poller replaces (class kv-html)."""
    return f'<div class="kv-html">{_MARKDOWN.render(markdown)}</div>'


def _render(name: str, state: LiveState, decode, views: PanelViews):
    snapshot = state.snapshot
    holders = any(seq.block_table for seq in snapshot.sequences)
    window = timeline.live_window(state.records, state.now)
    if name == "summary":
        return summary_markdown(snapshot)
    if name == "heatmap":
        return figures.pool_heatmap(snapshot, decode, views.heatmap_view, views.heatmap_start,
                                    views.heatmap_stop)
    if name == "block_tables":
        if not holders:
            return placeholder("Block tables", "No sequence holds blocks right now.")
        return figures.block_table_map(snapshot, decode, views.tables)
    if name == "prefix_tree":
        return figures.prefix_tree(snapshot, decode)
    if name == "timeline":
        return timeline.request_timeline(state.records, state.arrivals, window)
    if name == "series":
        return timeline.pool_series(state.records, state.token_usage, window)
    if name == "spec_decode":
        return spec_decode.spec_decode_panel(state.records, window)
    if name == "stats":
        queries = snapshot.prefix_cache_queries
        return timeline.stats_markdown(
            timeline.latency_stats(timeline.in_window(state.records, window), state.arrivals),
            snapshot.prefix_cache_hits / queries if queries else None,
            snapshot.num_preemptions,
            (f"last {timeline.RATE_WINDOW_S:.0f} s",
             timeline.recent_output_rate(state.records, state.now)))
    if not holders:
        return placeholder("Paged against contiguous", "No live sequences: the comparison "
                           "appears while requests hold blocks.")
    return figures.paged_vs_contiguous(snapshot)


@dataclass(slots=True)
class _Rendered:
    signature: object
    value: object
    at: float
    version: int  # what a tab says it shows: unique per render, and plain JSON


class PanelRenderer:
    """One render per panel change, shared by every tab (a tab receives only panels it
    has not shown yet). While the engine is busy a panel is rebuilt at most every
    cost / PANEL_DUTY seconds (1 to 8 s), so the dashboard's cost follows its own
    measured build times, not the pool's size or the number of open tabs."""

    def __init__(self, feed: LiveFeed) -> None:
        self.feed = feed
        self._lock = threading.Lock()  # one render pass at a time, whatever the tab count
        self._rendered: dict[str, _Rendered] = {}
        self._cost: dict[str, float] = {}
        self._versions = itertools.count(1)

    def interval(self, name: str) -> float:
        return min(max(REFRESH_S, self._cost.get(name, 0.0) / PANEL_DUTY), MAX_INTERVAL_S)

    def _due(self, name: str, signature: tuple, state: LiveState, now: float) -> bool:
        """signature: (what the panel shows, the view the tab chose)."""
        rendered = self._rendered.get(name)
        if rendered is None or rendered.signature[1] != signature[1]:
            return True  # a new view is drawn at once
        if rendered.signature == signature:
            return False
        return not state.busy or now - rendered.at >= self.interval(name) - TICK_SLACK_S

    def refresh(self, shown: dict | None = None, visible: list[str] | None = None,
                *view_controls):
        """One value per panel in PANELS order (gr.skip() where this tab is up to date),
        then the render versions the tab now shows (`shown`, {panel: version}, is what it
        sent back from its previous refresh; None: nothing yet). `visible` names the panels the tab can see
        (None: all; the browser sends the ones on screen, ui/live_poller.js):
        only those are built and sent, and the summary line always is. `view_controls` are
        the heatmap's and block tables' controls (see panel_views); a bad value draws the
        default view and says why in a warning."""
        shown = shown or {}
        try:
            views = panel_views(*view_controls)
        except (TypeError, ValueError) as error:
            gr.Warning(f"View not changed: {error}")
            views = PanelViews()
        wanted = [name for name in PANELS
                  if name == "summary" or visible is None or name in visible]
        with self._lock:
            state = self.feed.refresh()
            signatures = {name: (data, views.of(name))
                          for name, data in _signatures(state).items()}
            for name in wanted:
                now = time.monotonic()
                if self._due(name, signatures[name], state, now):
                    value = _render(name, state, self.feed.decode, views)
                    value = text_html(value) if name in TEXT_PANELS else to_plot(value)
                    done = time.monotonic()
                    cost = self._cost.get(name, done - now)
                    self._cost[name] = cost + COST_SMOOTHING * (done - now - cost)
                    # A render that draws what the tabs already show keeps its version,
                    # so no tab is sent it or redraws it (the pool's counters move on
                    # every step; a panel's picture often does not).
                    previous = self._rendered.get(name)
                    version = (previous.version if previous is not None
                               and previous.value == value else next(self._versions))
                    self._rendered[name] = _Rendered(signatures[name], value, done, version)
            sent = {name: self._rendered[name] for name in wanted
                    if name in self._rendered and shown.get(name) !=
                    self._rendered[name].version}
        values = [sent[name].value if name in sent else gr.skip() for name in PANELS]
        return *values, {**shown, **{name: r.version for name, r in sent.items()}}
