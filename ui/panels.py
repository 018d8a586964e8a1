"""The live panels' handler: every panel rendered once per change for all tabs, and no
more often than its cost allows while the engine is busy."""

import itertools
import threading
import time
from dataclasses import dataclass

import gradio as gr
from markdown_it import MarkdownIt

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.worker.memory import MemoryPlan
from kvscope.ui import events, experts, figures, spec_decode, timeline, why
from kvscope.ui.live import LiveFeeds, LiveState
from kvscope.ui.plotdata import placeholder, to_plot
from kvscope.ui.state_slots import state_slots_markdown

PANELS = ("summary", "heatmap", "block_tables", "prefix_tree", "timeline", "series", "stats",
          "comparison", "events", "spec_decode", "experts", "state_slots")
# Each panel's element (the summary line sits above the tabs and is always sent).
PANEL_ELEMENTS = {name: f"kv-{name.replace('_', '-')}" for name in PANELS[1:]}
REFRESH_S = 1.0
# The page's poll while figures change at every tick (ui/live_poller.js).
BUSY_REFRESH_S = 2.0
# While the engine is busy the panels together may use this share of one core, shared
# between them (shared_intervals): panels that take 30 ms in all are rebuilt every
# second; a 200 ms heatmap beside cheap panels every ~7 s. One budget for all, not one
# per panel: during decode most panels change at every step, so a per-panel share would
# cost that share times the panel count. The engine shares the process (and its GIL)
# with these builders.
PANEL_DUTY = 0.03
MAX_INTERVAL_S = 8.0
# Timer ticks jitter; without slack a 1 s panel would land on every other tick.
TICK_SLACK_S = 0.2
COST_SMOOTHING = 0.3
# The summary and stats lines as HTML made here: the browser's poller (ui/live_poller.js)
# puts them in place without Gradio's Markdown renderer. Raw HTML in the text stays text.
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
TEXT_PANELS = ("summary", "stats", "events", "state_slots")


@dataclass(frozen=True, slots=True)
class PanelViews:
    """What a tab chose to look at: the heatmap's range, the block tables' page and the
    engine replica (each tab its own)."""

    heatmap_view: str = "whole pool"
    heatmap_start: int | None = None
    heatmap_stop: int | None = None
    tables: figures.TableView = figures.TableView()
    replica: int = 0
    follow: str = ""  # the request followed across the panels (its id; "" for none)
    frame: int | None = None  # the recorded frame shown (ui.scrubber); None: live

    def of(self, name: str) -> object:
        """The part of the view a panel depends on (None: it has no view)."""
        if name == "heatmap":
            return self.heatmap_view, self.heatmap_start, self.heatmap_stop, self.follow
        if name == "block_tables":
            return self.tables, self.follow
        return self.follow if name in ("timeline", "prefix_tree", "events") else None


# The view's number fields: (label on the page, the least value it takes).
VIEW_FIELDS = {"heatmap_start": ("from block", 0), "heatmap_stop": ("to block", 0),
               "table_page": ("page", 1)}


def check_view_fields(feeds: LiveFeeds, heatmap_start, heatmap_stop, table_page,
                      replica=0) -> tuple:
    """The view fields' values, each one the view cannot show refused at the field, with
    a warning naming it and its limit: put back to a value it can show (the refresh draws
    the view meanwhile): blocks past the pool, a range that ends before it starts."""
    feed = feeds.get(int(replica or 0))
    num_blocks = feed.engine.memory_plan.num_blocks
    values = []
    for name, value in zip(VIEW_FIELDS, (heatmap_start, heatmap_stop, table_page)):
        label, least = VIEW_FIELDS[name]
        if value is not None and value < least:
            gr.Warning(f"{label}={value:g} refused: it must be {least} or more")
            value = least
        elif name != "table_page" and value is not None and value > num_blocks:
            gr.Warning(f"{label}={value:g} refused: the pool has {num_blocks} blocks, so "
                       f"{label} is at most {num_blocks}")
            value = 0
        values.append(value)
    start, stop = values[:2]
    if start and stop and stop <= start:
        gr.Warning(f"to block={stop:g} refused: it must be more than from block={start:g} "
                   "(or 0: to the end)")
        values[1] = 0
    return tuple(values)


def check_frame(feeds: LiveFeeds, frame, replica=0) -> None:
    """The Live tab's frame field: blank (live) or a kept frame's number; anything else
    is said in a warning naming the field and what it takes. The field is not written
    back: the scrubber's ◀ and ▶ write it too, and the panels show live for a value that
    is not a number and the nearest kept frame for one out of range."""
    if frame is None or str(frame).strip() == "":
        return
    try:
        number = int(str(frame).strip())
    except ValueError:
        gr.Warning(f"frame shown={str(frame)[:40]!r} refused: enter a frame number, or "
                   "leave it blank for the live pool (shown meanwhile)")
        return
    feed = feeds.get(int(replica or 0))
    with feed.lock:
        first, last = feed.history.first, feed.history.last
    if first is None:
        gr.Warning(f"frame shown={number} refused: no frame is recorded yet (blank: live)")
    elif not first <= number <= last:
        gr.Warning(f"frame shown={number} refused: frames {first} to {last} are kept; "
                   f"showing frame {min(max(number, first), last)}")


def panel_views(heatmap_view=None, heatmap_start=None, heatmap_stop=None, table_order=None,
                table_page=None, table_filter=None, replica=None, follow=None,
                frame=None) -> PanelViews:
    """The views from the controls' raw values (None or blank = the default). A value a
    field refuses (check_view_fields) raises ValueError naming the field."""
    for name, value in (("heatmap_start", heatmap_start), ("heatmap_stop", heatmap_stop),
                        ("table_page", table_page)):
        label, least = VIEW_FIELDS[name]
        if value not in (None, "") and int(value) < least:
            raise ValueError(f"{label}={value} must be {least} or more")
    return PanelViews(
        heatmap_view or "whole pool",
        None if heatmap_start in (None, "") else int(heatmap_start),
        None if heatmap_stop in (None, "", 0) else int(heatmap_stop),  # 0: to the end
        figures.TableView(table_order or "most recent", max(int(table_page or 1), 1),
                          (table_filter or "").strip()),
        int(replica or 0), (follow or "").strip(),
        None if frame is None or str(frame).strip() == "" else int(frame))


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
        "summary": (pool, sequences, state.replica, hash(str(snapshot.config))),
        "heatmap": (pool, sequences),  # hover names the owners
        "block_tables": (pool, sequences, last_step),  # last_step: its verifications
        "prefix_tree": (pool, state.slots and state.slots.snapshots),
        "timeline": (last_step, len(state.arrivals)),
        "series": (last_step, snapshot.num_used_tokens),
        "stats": (last_step, snapshot.prefix_cache_hits, snapshot.num_preemptions, rate_clock),
        "comparison": (pool, sequences),
        "events": (last_step, len(state.evictions)),
        "spec_decode": last_step,
        "experts": last_step,
        "state_slots": (state.slots, snapshot.epoch),
    }


def summary_markdown(snapshot: PoolMirror, replica: int = 0, num_replicas: int = 1) -> str:
    """The line above the tabs: every figure with its unit, now (as of the last step);
    where it counts differently from /metrics it says so."""
    config = snapshot.config
    max_model_len = config.get("max_model_len") or 0
    per_sequence = -(-max_model_len // snapshot.block_size) if max_model_len else 0
    concurrency = snapshot.num_blocks / per_sequence if per_sequence else 0
    in_use = snapshot.num_blocks - snapshot.count("free") - snapshot.count("cached")
    running, waiting = snapshot.request_counts()
    where = f"**replica {replica}** of {num_replicas} · " if num_replicas > 1 else ""
    # The step says how current each panel is: under load a costly panel (the heatmap)
    # redraws less often than this line, and its title names its own step.
    line = (f"{where}**step** {snapshot.step} · **pool** {snapshot.num_blocks} blocks x "
            f"{snapshot.block_size} tokens = "
            f"{snapshot.num_blocks * snapshot.block_size} token slots, **{in_use} blocks in "
            f"use** ({in_use / max(snapshot.num_blocks, 1):.0%}) · **max concurrency** "
            f"{concurrency:.1f} sequences of {max_model_len} tokens · **running** "
            f"{_sequences(snapshot.num_running, running)} · **waiting** "
            f"{_sequences(snapshot.num_waiting, waiting)} · prefix caching "
            f"{'on' if config.get('enable_prefix_caching') else 'off'} · chunked prefill "
            f"{'on' if config.get('enable_chunked_prefill') else 'off'}")
    if (snapshot.num_running, snapshot.num_waiting) != (running, waiting):
        line += ("\n\n*A request with n > 1 samples runs as n sequences, each with its "
                 "own blocks: the pool counts sequences, /metrics' num_requests_running "
                 "and num_requests_waiting count requests.*")
    return line


def _sequences(num_sequences: int, num_requests: int) -> str:
    sequences = events.counted(num_sequences, "sequence")
    return (sequences if num_sequences == num_requests else
            f"{sequences} ({events.counted(num_requests, 'request')})")


def text_html(markdown: str) -> str:
    """A text panel's HTML, in the wrapper the poller replaces (class kv-html)."""
    return f'<div class="kv-html">{_MARKDOWN.render(markdown)}</div>'


def replica_down(statuses: list, replica: int) -> str:
    """The summary line's opening while the tab's replica is down ("" while it serves):
    its panels then show the last state it sent."""
    status = statuses[replica]
    if status.alive:
        return ""
    why = f": {status.error}" if status.error else ""
    return (f"**replica {replica} is down**{why} (restarted {status.restarts} times); the "
            "panels show the last state it sent · ")


def _render(name: str, state: LiveState, decode, views: PanelViews, num_replicas: int,
            window: tuple[float, float], down: str = "", plan: MemoryPlan | None = None):
    """window: the time panels' shared x range (timeline.live_window, once per refresh);
    down: replica_down's line for the tab's replica; plan: the engine's memory plan."""
    snapshot = state.snapshot
    if name == "state_slots":  # its panel is shown only for a model with recurrent layers
        return state_slots_markdown(state.slots, plan) if plan.bytes_per_state_slot else ""
    holders = any(seq.block_table for seq in snapshot.sequences)
    if name == "summary":
        line = down + summary_markdown(snapshot, state.replica, num_replicas)
        frame = state.paused
        return line if frame is None else (
            f"**paused at frame {frame.number}** (the pool after step {frame.step}; the "
            "engine runs on) · " + line)
    if name == "heatmap":
        return figures.pool_heatmap(snapshot, decode, views.heatmap_view, views.heatmap_start,
                                    views.heatmap_stop, views.follow, state.blocks_step)
    if name == "block_tables":
        if not holders:
            return placeholder("Block tables", "No sequence holds blocks right now.")
        return figures.block_table_map(
            snapshot, decode, views.tables, views.follow,
            spec_decode.latest_verifications(state.records, snapshot.step))
    if name == "prefix_tree":
        return figures.prefix_tree(snapshot, decode, views.follow, frozenset(
            block_hash for _, block_hash in state.slots.snapshots) if state.slots else
            frozenset())
    if name == "timeline":
        return timeline.request_timeline(state.records, state.arrivals, window, views.follow)
    if name == "series":
        return timeline.pool_series(state.records, state.usage_samples, window)
    if name == "spec_decode":
        return spec_decode.spec_decode_panel(state.records, window)
    if name == "experts":
        return experts.experts_panel(state.records, window)
    if name == "stats":
        counters = state.counters or snapshot  # a past frame: its pool's own totals
        return timeline.stats_markdown(
            timeline.latency_stats(timeline.in_window(state.records, window), state.arrivals),
            timeline.HitRates(snapshot.prefix_cache_hits, snapshot.prefix_cache_queries,
                              counters.prefix_cache_hits, counters.prefix_cache_queries),
            snapshot.num_preemptions,
            (f"last {timeline.RATE_WINDOW_S:.0f} s",
             timeline.recent_output_rate(state.records, state.now)))
    if name == "events":
        log = events.events_markdown(state.records, state.evictions)
        if not views.follow:
            return log
        return why.why_markdown(state.records, state.arrivals, views.follow) + "\n\n" + log
    if not holders:
        return placeholder("Paged against contiguous", "No live sequences: the comparison "
                           "appears while requests hold blocks.")
    return figures.paged_vs_contiguous(snapshot)


def shared_intervals(costs: dict[str, float], duty: float, least: float,
                     most: float) -> dict[str, float]:
    """Each panel's interval between rebuilds (or draws) while it changes at every step,
    from its cost (seconds each time), so that all together use at most `duty` of a core:
    the budget is shared max-min fairly. The cheapest panels go first; a panel whose
    equal share of what is left covers it at `least` runs at `least` and leaves the rest
    to the others; the costly ones split what remains. A slow heatmap so never slows the
    stats line. ui/live_poller.js shares the browser's drawing budget the same way."""
    intervals: dict[str, float] = {}
    left = duty
    order = sorted(costs, key=costs.get)
    for index, name in enumerate(order):
        share = left / (len(order) - index)
        interval = max(least, costs[name] / share) if share > 0 else most
        intervals[name] = min(interval, most)
        left -= costs[name] / interval if share > 0 else 0.0
    return intervals


@dataclass(slots=True)
class _Rendered:
    signature: object
    value: object
    at: float
    version: int  # what a tab says it shows: unique per render, and plain JSON


class PanelRenderer:
    """One render per panel change, shared by every tab (a tab receives only panels it
    has not shown yet). While the engine is busy a changed panel is rebuilt at most as
    often as keeps all panels' measured build times under PANEL_DUTY of a core together
    (shared_intervals; 1 to 8 s), so the dashboard's cost
    follows its own measured build times, not the pool's size, the number of panels
    that change or the number of open tabs. The summary line is exempt: it is small and
    says how current the panels are."""

    def __init__(self, feeds: LiveFeeds) -> None:
        self.feeds = feeds
        self._lock = threading.Lock()  # one render pass at a time, whatever the tab count
        self._rendered: dict[int, dict[str, _Rendered]] = {}  # per replica, per panel
        self._paused: dict[int, dict[str, _Rendered]] = {}  # the same, of a past frame
        self._cost: dict[str, float] = {}
        self._versions = itertools.count(1)

    def interval(self, name: str) -> float:
        if name == "summary":
            return REFRESH_S
        costs = {panel: cost for panel, cost in self._cost.items() if panel != "summary"}
        return shared_intervals(costs, PANEL_DUTY, REFRESH_S, MAX_INTERVAL_S).get(name,
                                                                                 REFRESH_S)

    def _due(self, rendered: _Rendered | None, name: str, signature: tuple,
             state: LiveState, now: float) -> bool:
        """signature: (what the panel shows, the view the tab chose)."""
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
        the heatmap's and block tables' controls and the replica (see panel_views); a bad
        value draws the default view and says why in a warning."""
        # Both come from the page's poller, or from any API caller: anything else than
        # what the poller sends counts as "nothing sent". `shown` is sent back, so only its
        # panels' versions are kept (an integer past 64 bits broke the JSON reply).
        shown = ({name: version for name, version in shown.items()
                  if name in PANELS and type(version) is int and 0 <= version < 2 ** 63}
                 if isinstance(shown, dict) else {})
        if not (isinstance(visible, list) and all(isinstance(name, str) for name in visible)):
            visible = None
        try:
            views = panel_views(*view_controls)
        except (TypeError, ValueError) as error:
            gr.Warning(f"View not changed: {error}")
            views = PanelViews()
        wanted = [name for name in PANELS
                  if name == "summary" or visible is None or name in visible]
        feed = self.feeds.get(views.replica)
        with self._lock, feed.lock:  # the feed's mirror holds still while panels read it
            state = feed.refresh() if views.frame is None else feed.state_at(views.frame)
            paused = state.paused is not None
            # A past frame never changes: its panels are drawn once per view, at once.
            rendered = (self._paused if paused else self._rendered).setdefault(
                views.replica, {})
            signatures = {name: (state.paused.number if paused else data, views.of(name))
                          for name, data in _signatures(state).items()}
            engine = feed.engine
            down = (replica_down(engine.replica_statuses(), views.replica)
                    if engine.num_replicas > 1 else "")
            signatures["summary"] += (down,)
            window = timeline.live_window(state.records, state.now)
            for name in wanted:
                now = time.monotonic()
                previous = rendered.get(name)
                if (previous is None or previous.signature != signatures[name] if paused
                        else self._due(previous, name, signatures[name], state, now)):
                    value = _render(name, state, feed.decode, views, engine.num_replicas,
                                    window, down, engine.memory_plan)
                    value = text_html(value) if name in TEXT_PANELS else to_plot(value)
                    done = time.monotonic()
                    cost = self._cost.get(name, done - now)
                    self._cost[name] = cost + COST_SMOOTHING * (done - now - cost)
                    # A render that draws what the tabs already show keeps its version,
                    # so no tab is sent it or redraws it (the pool's counters move on
                    # every step; a panel's picture often does not).
                    version = (previous.version if previous is not None
                               and previous.value == value else next(self._versions))
                    rendered[name] = _Rendered(signatures[name], value, done, version)
            sent = {name: rendered[name] for name in wanted
                    if name in rendered and shown.get(name) != rendered[name].version}
        values = [sent[name].value if name in sent else gr.skip() for name in PANELS]
        return *values, {**shown, **{name: r.version for name, r in sent.items()}}
