"""Runs side by side: the --json summaries, CSV, and a self-contained HTML report.

A simulated run's summary names its step-cost model's source (the log or file given, or
the self-calibration: its cache file, when it was made, in how long, its steps and fit
error); the report and the command's table print it above the runs.

The HTML embeds plotly.js from the plotly package (no network): KV usage over time, the
TTFT and TPOT CDFs, prefix hit rate and preemptions per run, and the summary table. Files
are written to a temporary name and renamed into place, so a failed run leaves none half
written.
"""

import csv
import html
import io
import json
import os
import tempfile
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.engine.replay.metrics import RunResult

SUMMARY_COLUMNS = ("label", "mode", "num_requests", "num_steps", "num_blocks",
                   "num_output_tokens", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                   "tpot_p50_s", "preemptions", "swapped_blocks", "prefix_hit_rate",
                   "peak_kv_usage", "mean_kv_usage", "makespan_s", "wall_s")
REQUEST_COLUMNS = ("label", "mode", "request_id", "arrival_s", "num_prompt_tokens",
                   "num_output_tokens", "ttft_s", "tpot_s", "finished_s")


def summaries(results: list[RunResult]) -> list[dict]:
    return [result.summary() for result in results]


def cost_model_lines(rows: list[dict]) -> list[str]:
    """'step-cost model of runs 1, 2: <where it came from>' for each model the simulated
    runs among these summaries used."""
    runs_by_model: dict[str, list[str]] = {}
    for index, row in enumerate(rows):
        if row.get("cost_model") is not None:
            runs_by_model.setdefault(row["cost_model"]["description"], []).append(str(index + 1))
    return [f"step-cost model of run{'s' * (len(runs) > 1)} {', '.join(runs)}: {text}"
            for text, runs in runs_by_model.items()]


def runs_csv(results: list[RunResult]) -> str:
    """One row per run: its config (JSON) and every summary number."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(("config", *SUMMARY_COLUMNS))
    for summary in summaries(results):
        writer.writerow((json.dumps(summary["config"]), *(summary[c] for c in SUMMARY_COLUMNS)))
    return out.getvalue()


def requests_csv(results: list[RunResult]) -> str:
    """One row per request per run: the latencies behind the CDFs."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(REQUEST_COLUMNS)
    for result in results:
        for r in result.requests:
            writer.writerow((result.label, result.mode, r.request_id, r.arrival_s,
                             r.num_prompt_tokens, r.num_output_tokens, r.ttft_s, r.tpot_s,
                             r.finished_s))
    return out.getvalue()


def run_name(index: int, result: RunResult) -> str:
    return f"run {index + 1}: {result.label} ({result.mode})"


def comparison_figures(results: list[RunResult]) -> dict[str, go.Figure]:
    """The report's figures, one trace per run (the dashboard's Compare tab shows them too)."""
    usage = go.Figure(layout={"title": "KV cache usage (used blocks / blocks)",
                              "xaxis_title": "seconds", "yaxis_title": "usage",
                              "yaxis_range": [0, 1.02]})
    latency = make_subplots(rows=1, cols=2, subplot_titles=("TTFT CDF", "TPOT CDF"))
    bars = make_subplots(rows=1, cols=2, subplot_titles=("prefix hit rate", "preemptions"))
    for index, result in enumerate(results):
        name, color, short = run_name(index, result), _color(index), f"run {index + 1}"
        series = result.kv_usage_series(4000)
        usage.add_scatter(x=[p[0] for p in series], y=[p[1] for p in series], name=name,
                          mode="lines", line={"color": color, "shape": "hv"})
        for col, metric in ((1, "ttft_s"), (2, "tpot_s")):
            values = result.latencies(metric)
            latency.add_scatter(x=values, y=[(i + 1) / len(values) for i in range(len(values))],
                                name=name, legendgroup=name, showlegend=col == 1,
                                mode="lines", line={"color": color, "shape": "hv"},
                                row=1, col=col)
        summary = result.summary()
        bars.add_bar(x=[short], y=[summary["prefix_hit_rate"]], marker_color=color,
                     name=name, hovertext=name, showlegend=False, row=1, col=1)
        bars.add_bar(x=[short], y=[summary["preemptions"]], marker_color=color,
                     name=name, hovertext=name, showlegend=False, row=1, col=2)
    for figure in (usage, latency):  # under the plots: long config labels take no width
        figure.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.2})
    latency.update_xaxes(title_text="seconds")
    latency.update_yaxes(title_text="fraction of requests", range=[0, 1.02], col=1)
    return {"kv_usage": usage, "latency_cdfs": latency, "hit_rate_preemptions": bars}


def _color(index: int) -> str:
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
    return palette[index % len(palette)]


def html_report(results: list[RunResult], title: str) -> str:
    """One HTML file that opens offline: plotly.js inlined once, the figures, the table."""
    figures = comparison_figures(results)
    parts = [figure.to_html(full_html=False, include_plotlyjs=index == 0,
                            default_height="420px")
             for index, figure in enumerate(figures.values())]
    header = "".join(f"<th>{html.escape(c)}</th>" for c in ("run", "config", *SUMMARY_COLUMNS))
    rows = "".join(
        f"<tr><td>{index + 1}</td><td>{html.escape(json.dumps(s['config']))}</td>"
        + "".join(f"<td>{_cell(s[c])}</td>" for c in SUMMARY_COLUMNS) + "</tr>"
        for index, s in enumerate(summaries(results)))
    cost_models = "".join(f"<p class='cost-model'>{html.escape(line)}</p>"
                          for line in cost_model_lines(summaries(results)))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style>"
            f"</head><body><h1>{html.escape(title)}</h1>{cost_models}<table id='runs'>"
            f"<tr>{header}</tr>{rows}</table>{''.join(parts)}</body></html>")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def write_report(results: list[RunResult], out_dir: str | Path, title: str,
                 extra: dict[str, str] | None = None) -> list[Path]:
    """report.html, runs.csv, requests.csv and runs.json under out_dir, and the `extra`
    files (name -> text) beside them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    contents = {"report.html": html_report(results, title), "runs.csv": runs_csv(results),
                "requests.csv": requests_csv(results),
                "runs.json": json.dumps(summaries(results), indent=1), **(extra or {})}
    written = []
    for name, text in contents.items():
        with tempfile.NamedTemporaryFile("w", dir=out_dir, delete=False, suffix=".tmp",
                                         encoding="utf-8") as file:
            file.write(text)
        os.replace(file.name, out_dir / name)
        written.append(out_dir / name)
    return written
