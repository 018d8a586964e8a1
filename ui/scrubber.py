"""The step scrubber: pause the panels and step back and forth through the pool's recorded
frames (one per delta the engine sent: a step's allocations, shares, evictions,
preemptions and swaps), on the Live tab and for a saved session on the Sessions tab.

A frame is the pool after one recorded delta (engine.telemetry.pool_history). The Live
tab's frames come from the tab's LiveFeed; a saved session's from its log's pool records.
"""

import threading

import gradio as gr

from kvscope.engine.telemetry.pool_history import Frame, PoolHistory
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.ui import events, figures, panels, spec_decode
from kvscope.ui.events import counted
from kvscope.ui.plotdata import placeholder, to_plot

NOTHING_YET = "No frames recorded yet: the scrubber steps through the pool once the engine runs."


def frame_changes(before: PoolMirror | None, after: PoolMirror) -> str:
    """What one frame did to the pool, in plain words (block transitions between the
    frame before it and this one)."""
    if before is None:
        return "the oldest frame kept"
    if before.epoch != after.epoch or before.num_blocks != after.num_blocks:
        return "the pool was rebuilt (a reconfigure)"
    refs_before, refs_after = before.ref_counts, after.ref_counts
    hashed_before = before.hashed
    changed_hash = (hashed_before != after.hashed) | (after.hashed & (
        before.hash_keys != after.hash_keys))
    taken = (refs_before == 0) & (refs_after > 0)
    parts = {
        "allocated": taken & ~(hashed_before & ~changed_hash),
        "revived from the cache (a prefix hit)": taken & hashed_before & ~changed_hash,
        "shared one more time": (refs_before > 0) & (refs_after > refs_before),
        "released (still held by others)": (refs_after > 0) & (refs_after < refs_before),
        "freed": (refs_before > 0) & (refs_after == 0),
        "cached (full, hashed)": after.hashed & changed_hash,
    }
    words = [f"{counted(int(mask.sum()), 'block')} {name}" for name, mask in parts.items()
             if mask.any()]
    evicted = after.num_evictions - before.num_evictions
    if evicted:
        words.append(f"{counted(evicted, 'cached block')} evicted (least recently used first)")
    preempted = after.num_preemptions - before.num_preemptions
    if preempted:
        words.append(f"{counted(preempted, 'sequence')} preempted")
    joined = set(after.live) - set(before.live)
    left = set(before.live) - set(after.live)
    if joined:
        words.append(f"{counted(len(joined), 'sequence')} queued")
    if left:
        words.append(f"{counted(len(left), 'sequence')} left (finished or aborted)")
    return "; ".join(words) or "no block changed (tokens were written into held blocks)"


# How a tab leaves the frames it steps through: the Live tab has a Live button; the
# Sessions tab's field, blank, shows the session's last frame.
LIVE_TAB_WAY_OUT = "Live returns to the live pool"
SESSIONS_TAB_WAY_OUT = "a blank frame field shows the last frame"


def frame_status(history: PoolHistory, frame: Frame | None, changes: str = "",
                 way_out: str = LIVE_TAB_WAY_OUT) -> str:
    if frame is None:
        return NOTHING_YET
    return (f"**Paused at frame {frame.number}** (the pool after {frame.step} steps: "
            f"pool delta {frame.index}; frames {history.first}–{history.last} kept): "
            f"{changes}. ◀ and ▶ step one frame; {way_out}.")


# ---- the Live tab -----------------------------------------------------------------------
def pause(feeds, replica) -> tuple:
    """(the frame field: the latest frame, the status line)."""
    feed = feeds.get(int(replica or 0))
    feed.refresh()
    number = feed.history.last
    return ("", NOTHING_YET) if number is None else (number, live_status(feeds, replica,
                                                                          number))


def step(feeds, replica, frame, by: int) -> tuple:
    """(the frame `by` frames from `frame`, clamped, the status line); paused at the
    latest frame if the scrubber was live."""
    feed = feeds.get(int(replica or 0))
    feed.refresh()
    if feed.history.last is None:
        return "", NOTHING_YET
    number = feed.history.clamp(feed.history.last if _blank(frame) else _number(frame) + by)
    return number, live_status(feeds, replica, number)


def resume() -> tuple:
    return "", "▶ **Live**: the panels follow the engine. Pause to step through its frames."


def _blank(frame) -> bool:
    return frame is None or str(frame).strip() == ""


def _number(frame) -> int:
    try:
        return int(str(frame).strip())
    except ValueError:
        # A user's typo, not a fault: a toast, and no traceback in the server's console.
        raise gr.Error(f"frame={str(frame)[:40]!r} must be a whole number (or blank)",
                       print_exception=False) from None


def live_status(feeds, replica, frame) -> str:
    feed = feeds.get(int(replica or 0))
    with feed.lock:  # before any frame is kept, the state is the live mirror
        state = feed.state_at(int(frame))
        return frame_status(feed.history, state.paused,
                            frame_changes(state.previous, state.snapshot))


# ---- the Sessions tab ---------------------------------------------------------------------
class SessionFrames:
    """A saved session's pool frames and step records, loaded once per session (and again
    when the live session's log has grown)."""

    def __init__(self, session_log, decode) -> None:
        self.session_log = session_log
        self.decode = decode  # token ids -> text, for hover and the prefix tree
        self._lock = threading.Lock()
        self._loaded: tuple | None = None  # (session id, pool rows, history, steps)

    def load(self, session_id: int) -> tuple[PoolHistory, list]:
        log = self.session_log
        log.flush(timeout=2.0)  # the live session's last half second too
        count = log.count_pool_records(session_id)
        with self._lock:
            if self._loaded is None or self._loaded[:2] != (session_id, count):
                stored = log.load_session(session_id)  # ValueError: no such session
                self._loaded = (session_id, count, log.pool_history(session_id), stored.steps)
            return self._loaded[2], self._loaded[3]

    def show(self, session_id, frame, by: int = 0) -> tuple:
        """(frame field, status, summary, heatmap, block tables, prefix tree, events) of
        the session's pool at `frame` + `by` (None: its last frame)."""
        if self.session_log is None or session_id in (None, ""):
            return "", "Pick a session.", *_no_frame("Pick a session to step through its pool.")
        try:
            history, steps = self.load(int(session_id))
        except ValueError as error:
            gr.Warning(str(error))
            return "", str(error), *_no_frame(str(error))
        if history.last is None:
            why = ("This session has run no engine step yet: its pool's frames appear once "
                   "a request runs (Refresh, then pick it again)." if not steps else
                   "This session has no pool records (logged before kvscope kept them, or "
                   "by several replicas).")
            return "", why, *_no_frame(why)
        number = history.clamp(None if _blank(frame) else _number(frame) + by)
        shown = history.frame(number)
        pool = history.mirror_at(number)
        before = history.mirror_at(number - 1) if number > history.first else None
        decode = self.decode
        records = [record for record in steps if record.step < shown.step]
        tables = (figures.block_table_map(
                      pool, decode, verified=spec_decode.latest_verifications(records, pool.step))
                  if any(seq.block_table for seq in pool.sequences) else
                  placeholder("Block tables", "No sequence held blocks at this frame."))
        return (number, frame_status(history, shown, frame_changes(before, pool),
                                     SESSIONS_TAB_WAY_OUT),
                panels.summary_markdown(pool),
                to_plot(figures.pool_heatmap(pool, decode, as_of=shown.step)),
                to_plot(tables), to_plot(figures.prefix_tree(pool, decode)),
                events.events_markdown(records))


def _no_frame(why: str) -> tuple:
    """(summary, heatmap, block tables, prefix tree, events) with no frame to show: each
    panel says why, so none keeps another session's pictures or stands blank."""
    return ("", *(to_plot(placeholder(title, why)) for title in
                  ("Block pool", "Block tables", "Prefix-sharing tree")), "")
