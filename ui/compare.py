"""The Compare tab: a recorded session or an uploaded trace, replayed under two to four
configs (simulated by default, live on request), the runs overlaid, the report to download.

Replays run on the handler's thread on engines of their own (simulated: no weights; live: a
second copy of the weights, loaded once per tab run), never on the dashboard's engine.
"""

import tempfile
from pathlib import Path

import gradio as gr

from kvscope.engine.config import BLOCK_SIZES, PREEMPTION_MODES, EngineConfig
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.replay.cost_model import fit_step_cost
from kvscope.engine.replay.report import comparison_figures, summaries, write_report
from kvscope.engine.replay.runner import ReplaySession, base_config
from kvscope.engine.replay.traces import load_trace
from kvscope.storage.replay_source import load_logged_steps, load_session_workload
from kvscope.ui.form_values import form_number
from kvscope.ui.plotdata import panel, to_plot
from kvscope.ui.sessions import session_time

MAX_CONFIGS = 4
SOURCES = ("recorded session", "uploaded trace")
MODES = ("simulated", "live")
# The knobs each config sets, in the order of its widgets (compare_tab builds them).
KNOBS = ("block_size", "gpu_memory_utilization", "num_gpu_blocks_override", "max_num_seqs",
         "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
         "preemption_mode")
CHECK_CLASS = "kv-card-check"
TABLE_COLUMNS = ["run", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                 "preemptions", "prefix_hit_rate", "peak_kv_usage", "mean_kv_usage", "wall_s"]


def compare_tab(engine: EngineView, session_log, tab: gr.Tab) -> None:
    """The tab's widgets and its one Run event (api name `compare_runs`); `tab` is the tab
    they sit in, whose opening lists the sessions recorded so far."""
    config = engine.config
    gr.Markdown("### Compare configs on the same traffic\nReplays run on their own engine "
                "(or the simulator), never on the one serving this dashboard.")
    with gr.Row():
        source = gr.Radio(list(SOURCES), value=SOURCES[0], label="replay")
        session = gr.Dropdown(choices=[], label="session", allow_custom_value=True,
                              elem_id="kv-compare-session")
        trace = gr.File(label="trace (.jsonl Mooncake, .csv Azure, .json ShareGPT)",
                        file_types=[".jsonl", ".csv", ".json"], type="filepath",
                        elem_id="kv-compare-trace")
    with gr.Row():
        mode = gr.Radio(list(MODES), value=MODES[0], label="mode",
                        info="simulated: real scheduler, modelled step times; live: the model")
        speed = gr.Number(1.0, label="speed (x arrivals)")
    knob_widgets = []
    # Each widget as wide as its label: a row too narrow for all of them wraps (squeezed
    # into one line, the labels were cut). Gradio's Checkbox drops min_width and scale, so
    # the checkboxes are held at their label's width by CHECK_CLASS in ui/dashboard.css.
    wide = {"min_width": 210}
    check = {"elem_classes": [CHECK_CLASS]}
    for index in range(MAX_CONFIGS):
        with gr.Row(variant="panel"):
            knob_widgets += [
                gr.Checkbox(index < 2, label=f"run {index + 1}", **check),
                gr.Dropdown(list(BLOCK_SIZES), value=config.block_size, label="block_size",
                            **wide),
                gr.Slider(0.01, 1.0, value=config.gpu_memory_utilization, step=0.01,
                          label="gpu_memory_utilization", **wide),
                gr.Number(config.num_gpu_blocks_override or 0, precision=0,
                          label="num_gpu_blocks_override", info="0 = from memory", **wide),
                gr.Number(config.max_num_seqs, precision=0, label="max_num_seqs", **wide),
                gr.Number(config.max_num_batched_tokens, precision=0,
                          label="max_num_batched_tokens", **wide),
                gr.Checkbox(config.enable_prefix_caching, label="prefix caching", **check),
                gr.Checkbox(config.enable_chunked_prefill, label="chunked prefill", **check),
                gr.Radio(list(PREEMPTION_MODES), value=config.preemption_mode,
                         label="preemption mode", **wide)]
    run = gr.Button("Run", variant="primary", elem_id="kv-compare-run")
    status = gr.Markdown(elem_id="kv-compare-status")
    table = gr.Dataframe(headers=TABLE_COLUMNS, interactive=False, label="Runs")
    usage = panel("KV usage over time", "kv-compare-usage")
    latency = panel("Latency CDFs", "kv-compare-latency")
    bars = panel("Prefix hit rate and preemptions", "kv-compare-bars")
    report = gr.File(label="Report", interactive=False, elem_id="kv-compare-report")

    def handler(source, session, trace, mode, speed, *values, progress=gr.Progress()):
        return compare_runs(engine, session_log, source, session, trace, mode, speed, values,
                            progress)

    run.click(handler, [source, session, trace, mode, speed, *knob_widgets],
              [status, table, usage, latency, bars, report], api_name="compare_runs",
              concurrency_limit=1)
    for opened in (tab.select, session.focus):
        opened(lambda picked: _session_choices(session_log, picked), session, session,
               show_progress="hidden", api_visibility="private")


def _session_choices(session_log, picked):
    """The logged sessions that served requests, newest first, each labelled with what it
    holds; the user's pick stays, and otherwise the newest is picked."""
    if session_log is None:
        return gr.update(choices=[])
    sessions = [s for s in session_log.list_sessions() if s["num_requests"]]
    choices = [(f"session {s['id']}{' (this one)' if s['id'] == session_log.session_id else ''}"
                f": {s['num_requests']} requests, started "
                f"{session_time(s['started_at'])}", s["id"])
               for s in sessions]
    ids = [s["id"] for s in sessions]
    return gr.update(choices=choices, value=picked if picked in ids else next(iter(ids), None))


def config_changes(base: EngineConfig, values: tuple) -> list[dict]:
    """Per enabled config row, the knobs that differ from `base` (a row of the widgets'
    values: `enabled`, then KNOBS in order); 0 overrides nothing."""
    width = 1 + len(KNOBS)
    runs = []
    for start in range(0, len(values), width):
        enabled, *row = values[start:start + width]
        if not enabled:
            continue
        knobs = dict(zip(KNOBS, row))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            knobs[name] = form_number(f"run {start // width + 1} {name}", knobs[name],
                                      integer=True)
        override = knobs["num_gpu_blocks_override"]
        knobs["num_gpu_blocks_override"] = form_number(
            f"run {start // width + 1} num_gpu_blocks_override", override or 0,
            integer=True) or None
        knobs["gpu_memory_utilization"] = form_number(
            f"run {start // width + 1} gpu_memory_utilization", knobs["gpu_memory_utilization"])
        runs.append({k: v for k, v in knobs.items() if v != getattr(base, k)})
    if not 2 <= len(runs) <= MAX_CONFIGS:
        raise ValueError(f"configs: enable 2 to {MAX_CONFIGS} runs (got {len(runs)})")
    return runs


def compare_runs(engine: EngineView, session_log, source: str, session_id, trace_path,
                 mode: str, speed, values: tuple, progress=None):
    """(status, table rows, three figures, report path); bad input is a message."""
    try:
        workload, session = _replay_session(engine, session_log, source, session_id,
                                            trace_path, mode)
        runs = config_changes(session.base, values)
        for knobs in runs:
            session.base.with_changes(**knobs)  # a bad knob fails before any run
        results = []
        for index, knobs in enumerate(runs):
            def tick(done: int, total: int, index=index) -> None:
                if progress is not None:
                    progress((index + done / total) / len(runs),
                             desc=f"run {index + 1}/{len(runs)}: {done}/{total} requests")

            results.append(session.run(knobs, mode, float(speed or 1.0), tick))
    except ValueError as error:
        gr.Warning(str(error))
        return (f"**Not run:** {error}", gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                gr.skip())
    folder = Path(tempfile.mkdtemp(prefix="kvscope-compare-"))
    write_report(results, folder, f"kvscope replay of {workload.name}")
    figures = comparison_figures(results)
    rows = [[f"{index + 1}: {s['label']} ({s['mode']})", *(_short(s[c]) for c in TABLE_COLUMNS[1:])]
            for index, s in enumerate(summaries(results))]
    status = (f"{len(results)} {mode} runs of {len(workload.requests)} requests "
              f"({workload.name})")
    return (status, rows, *(to_plot(f) for f in figures.values()),
            str(folder / "report.html"))


def _short(value):
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _replay_session(engine: EngineView, session_log, source, session_id, trace_path, mode):
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {list(MODES)}")
    if source == SOURCES[0]:
        if session_log is None or not str(session_id or "").isdigit():
            raise ValueError(f"session: pick a recorded session from the list (got "
                             f"{session_id!r}; the app keeps a log with --db)")
        session_log.flush(timeout=2.0)
        workload = load_session_workload(session_log.db_path, int(session_id))
        base = base_config(workload)
    else:
        if not trace_path:
            raise ValueError("trace: upload a trace file first")
        workload = load_trace(trace_path, engine.tokenizer)
        base = engine.config
    cost_model = None
    if mode == "simulated":
        steps = workload.steps
        if not steps and session_log is not None:
            session_log.flush(timeout=2.0)
            steps = load_logged_steps(session_log.db_path, session_log.session_id)
        cost_model = fit_step_cost(steps)
    return workload, ReplaySession(workload, base, cost_model)
