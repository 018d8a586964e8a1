"""The sessions tab's handlers: list past sessions, redraw one, export it."""

import tempfile
from datetime import datetime

import gradio as gr

from kvscope.ui import tiers, timeline
from kvscope.ui.plotdata import to_plot

# The log writes a request when it finishes: the live session counts only those.
SESSION_COLUMNS = ["id", "model", "started", "ended", "finished requests", "steps",
                   "chat messages", "block size", "prefix caching"]
NO_LOG = "The session log is off (start the app with --db PATH to keep one)."


def session_time(value: float | None) -> str:
    return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S") if value else "–"


def list_sessions(session_log, selected=None):
    """(table rows, session choices, status); the chosen session stays `selected` while
    it is listed (a tab shown again keeps what the user picked), else the newest."""
    if session_log is None:
        return [], gr.update(choices=[]), NO_LOG
    sessions = session_log.list_sessions()
    rows = [[s["id"], s["model"].rsplit("/", 1)[-1], session_time(s["started_at"]),
             session_time(s["ended_at"]), s["num_requests"], s["num_steps"], s["num_chat_messages"],
             block_sizes(s), s["config"].get("enable_prefix_caching")]
            for s in sessions]
    choices = [s["id"] for s in sessions]
    value = next((choice for choice in choices if str(choice) == str(selected)),
                 choices[0] if choices else None)
    count = f"{len(sessions)} session{'' if len(sessions) == 1 else 's'}"
    return rows, gr.update(choices=choices, value=value), f"{count} in {session_log.db_path}"


def block_sizes(session: dict) -> str:
    """The block sizes a session ran, the one it ran most steps with first: "16", or
    "16 (900 steps), 8 (100 steps)" after reconfigures."""
    sizes = session["block_sizes"] or [(session["config"].get("block_size"), None)]
    if len(sizes) == 1:
        return str(sizes[0][0])
    return ", ".join(f"{size} ({steps} steps)" for size, steps in sizes)


def show_session(session_log, session_id):
    """(timeline, series, stats, configs) of one logged session."""
    if session_log is None or session_id is None:
        return gr.skip(), gr.skip(), NO_LOG if session_log is None else "Pick a session.", {}
    try:
        session_log.flush(timeout=2.0)  # the live session's last half second too
        stored = session_log.load_session(int(session_id))
    except ValueError as error:
        gr.Warning(str(error))
        return gr.skip(), gr.skip(), str(error), {}
    arrivals = {row["request_id"]: row["arrival_time"] for row in stored.requests
                if row["arrival_time"] is not None}
    # The latest config, and every config the session ran with, each with the time it
    # took effect.
    config = {"latest": stored.session["config"],
              "history": [{"applied_at": session_time(entry["applied_at"]), **entry["config"]}
                          for entry in stored.configs]}
    latency = timeline.latency_stats(stored.steps, arrivals)
    stats = timeline.stats_markdown(latency, None, sum(len(r.preempted) for r in stored.steps),
                                    ("session average", latency.output_tokens_per_s))
    if tier := tiers.session_tier_markdown(stored.steps):
        stats += "\n\n" + tier
    # Usage is drawn against each step's own pool (used + cached + free blocks), so a
    # session with reconfigures reads right on every side of them.
    return (to_plot(timeline.request_timeline(stored.steps, arrivals)),
            to_plot(timeline.pool_series(stored.steps)), stats, config)


def export_session(session_log, session_id, fmt: str):
    """(file to download, status); a missing session or format is a message, not a crash."""
    if session_log is None:
        return None, NO_LOG
    try:
        session_log.flush(timeout=2.0)
        path = session_log.export(int(session_id), fmt, tempfile.mkdtemp(prefix="kvscope-"))
    except (ValueError, TypeError) as error:
        message = (f"Nothing exported: {error}" if session_id is not None
                   else "Nothing exported: pick a session first.")
        gr.Warning(message)
        return None, message
    kind = " (a .zip holding one CSV file per table)" if path.suffix == ".zip" else ""
    return str(path), f"Exported session {session_id} as {fmt}: {path.name}{kind}"
