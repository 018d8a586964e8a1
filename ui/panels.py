"""The timer's handler: every live panel, skipping those whose data did not change."""

import time
from dataclasses import dataclass

import gradio as gr
import plotly.io as pio
from gradio.components.plot import PlotData

from engine.pool_mirror import PoolMirror
from ui import figures, timeline
from ui.live import LiveFeed, LiveState

BUSY_FACTOR = 3.0
PANELS = ("summary", "heatmap", "block_tables", "prefix_tree", "timeline", "series", "stats",
          "comparison")


@dataclass(frozen=True, slots=True)
class PanelViews:
    """What this tab chose to look at: the heatmap's range and the block tables' page."""

    heatmap_view: str = "whole pool"
    heatmap_start: int | None = None
    heatmap_stop: int | None = None
    tables: figures.TableView = figures.TableView()


def panel_views(heatmap_view=None, heatmap_start=None, heatmap_stop=None, table_order=None,
                table_page=None, table_filter=None) -> PanelViews:
    """The views from the controls' raw values (None or blank = the default)."""
    return PanelViews(
        heatmap_view or "whole pool",
        None if heatmap_start in (None, "") else int(heatmap_start),
        None if heatmap_stop in (None, "", 0) else int(heatmap_stop),  # 0: to the end
        figures.TableView(table_order or "most recent", max(int(table_page or 1), 1),
                          (table_filter or "").strip()))


def _signatures(state: LiveState, views: PanelViews) -> dict[str, object]:
    snapshot = state.snapshot
    # The mirror counts its own changes, so an unchanged pool costs nothing to notice.
    pool = (snapshot.epoch, snapshot.blocks_version, snapshot.ready)
    sequences = (snapshot.epoch, snapshot.sequences_version)
    last_step = state.records[-1].step if state.records else -1
    return {
        "summary": (snapshot.num_blocks, snapshot.block_size, snapshot.num_running,
                    snapshot.num_waiting, hash(str(snapshot.config))),
        "heatmap": (pool, sequences),
        "block_tables": (pool, sequences),
        "prefix_tree": pool,
        "timeline": (last_step, len(state.arrivals)),
        "series": (last_step, snapshot.num_used_tokens),
        "stats": (last_step, snapshot.prefix_cache_hits, snapshot.num_preemptions),
        "comparison": (pool, sequences),
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


def _render(name: str, state: LiveState, decode, views: PanelViews):
    snapshot = state.snapshot
    if name == "summary":
        return summary_markdown(snapshot)
    if name == "heatmap":
        return _plot(figures.pool_heatmap(snapshot, decode, views.heatmap_view,
                                          views.heatmap_start, views.heatmap_stop))
    if name == "block_tables":
        return _plot(figures.block_table_map(snapshot, decode, views.tables))
    if name == "prefix_tree":
        return _plot(figures.prefix_tree(snapshot, decode))
    if name == "timeline":
        return timeline.request_timeline(state.records, state.arrivals)
    if name == "series":
        return timeline.pool_series(state.records, snapshot.num_blocks, state.token_usage)
    if name == "stats":
        queries = snapshot.prefix_cache_queries
        return timeline.stats_markdown(
            timeline.latency_stats(state.records, state.arrivals),
            snapshot.prefix_cache_hits / queries if queries else None,
            snapshot.num_preemptions)
    return _plot(figures.paged_vs_contiguous(snapshot))


def _plot(figure: figures.Figure) -> PlotData:
    """What gr.Plot sends for a figure given as a plain dict (serialised once, as is)."""
    return PlotData(type="plotly", plot=pio.to_json(figure, validate=False))


def refresh_panels(feed: LiveFeed, shown: dict | None, *view_controls):
    """One value per panel in PANELS order (gr.skip() if unchanged), then the new
    signatures; `shown` is this browser tab's state, so each tab gets full panels once.
    `view_controls` are the values of the heatmap and block-table controls (see
    panel_views); a bad one draws the default view and says so in a warning."""
    try:
        views = panel_views(*view_controls)
    except (TypeError, ValueError) as error:
        gr.Warning(f"View not changed: {error}")
        views = PanelViews()
    shown = shown or {}
    values, sent = [], {}
    with feed.lock:  # the mirror stays still while this tab reads it
        state = feed.refresh()
        signatures = _signatures(state, views)
        for name in PANELS:
            view = (views.heatmap_view, views.heatmap_start, views.heatmap_stop) if (
                name == "heatmap") else views.tables if name == "block_tables" else None
            rendered = _rendered(feed, name, (signatures[name], view),
                                 lambda name=name: _render(name, state, feed.decode, views))
            sent[name] = rendered.signature
            values.append(gr.skip() if shown.get(name) == rendered.signature
                          else rendered.value)
    return *values, sent


@dataclass(frozen=True, slots=True)
class RenderedPanel:
    signature: tuple  # (what the panel shows, the view the tab chose)
    value: object
    seconds: float  # what building it cost
    built_at: float


def _rendered(feed: LiveFeed, name: str, signature, render) -> RenderedPanel:
    """The panel for this signature, built once for every tab. A panel whose data moved
    is rebuilt only after BUSY_FACTOR times its last build time has passed, so no panel
    takes more than about 1 / (1 + BUSY_FACTOR) of a core, whatever the pool's size;
    meanwhile tabs get the last one built."""
    cached = feed.rendered.get(name)
    now = time.monotonic()
    if cached is not None and (cached.signature == signature or (
            cached.signature[1] == signature[1]  # a new view is drawn at once
            and now - cached.built_at < BUSY_FACTOR * cached.seconds)):
        return cached
    value = render()
    feed.rendered[name] = panel = RenderedPanel(signature, value, time.monotonic() - now, now)
    return panel
