"""`kvscope replay SOURCE --config KEY=VALUE ... [--config ...]`: a run per config.

kvscope's own session logs are read by the SessionLogReader the caller hands `main`
(kvscope/cli.py hands it kvscope.storage.replay_source)."""

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from kvscope.engine.replay.calibration import COPIED_KNOBS, self_calibrated_cost
from kvscope.engine.replay.cost_model import CostModelSource, fit_step_cost, load_step_cost
from kvscope.engine.replay.divergence import divergence_csv, first_divergence
from kvscope.engine.replay.report import cost_model_lines, summaries, write_report
from kvscope.engine.replay.runner import ReplaySession, base_config, parse_knob
from kvscope.engine.replay.simulated_tier import DEFAULT_LOAD_GBPS, TierWhatIf
from kvscope.engine.replay.traces import FORMATS, load_trace
from kvscope.engine.replay.workload import SessionLogReader, Workload, is_session_log
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path

logger = logging.getLogger("kvscope.replay")
TABLE_COLUMNS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "preemptions",
                 "prefix_hit_rate", "peak_kv_usage", "wall_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope replay",
        description="Replay a recorded session (a kvscope .db log) or a public trace "
        "(Mooncake .jsonl, Azure .csv, ShareGPT .json) once per --config, live on the real "
        "engine or simulated (--simulate) on the real scheduler with a step-cost model.")
    parser.add_argument("source", help="a session log (.db) or a trace file")
    parser.add_argument("--config", action="append", nargs="+", default=[],
                        metavar="KEY=VALUE", help="one run with these engine knobs changed "
                        "(repeat for more runs; none: one run as recorded / the defaults)")
    parser.add_argument("--simulate", action="store_true",
                        help="simulate instead of running the model (real scheduler, KV-cache "
                        "manager and block pool; time from the step-cost model)")
    parser.add_argument("--cost-model", default=None,
                        help="simulate with the cost model fitted to this session log's "
                        "steps, or saved as JSON (default: the source log's own steps; a "
                        "trace: one calibrated on this machine by a short live profile, "
                        "cached beside the memory profiles)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="with --simulate and no --cost-model on a trace: calibrate the "
                        "step-cost model afresh instead of reading the cached one")
    parser.add_argument("--against-live", action="store_true",
                        help="with --simulate: run each config live too, and say where the "
                        "simulated pool first parts from the live one and why (--out: "
                        "divergence.csv, both pools step by step)")
    parser.add_argument("--save-cost-model", default=None, metavar="FILE",
                        help="write the cost model the simulation used as JSON (a later "
                        "--cost-model FILE reads it)")
    parser.add_argument("--kv-offload-gb", type=float, default=None, metavar="GIB",
                        help="what-if: with --simulate, run each config again over a disk "
                        "tier of this many GiB under the pool (both runs reported)")
    parser.add_argument("--kv-offload-gbps", type=float, default=DEFAULT_LOAD_GBPS,
                        metavar="GB_S", help="the simulated tier's load bandwidth (default: "
                        "the real tier's measured rate, docs/performance-history.md)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="arrivals this many times faster than recorded")
    parser.add_argument("--session", type=int, default=None,
                        help="session id in a .db source (default: the latest with requests)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="trace format (default: from the file's suffix)")
    parser.add_argument("--model", default=None,
                        help="model (default: the recorded session's, else kvscope's default)")
    parser.add_argument("--rate", type=float, default=None,
                        help="ShareGPT: Poisson arrivals at this many requests/s (default: "
                        "all at once; the format records no times)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="replay only the first N requests by arrival")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic prompt tokens")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list with one object per run")
    parser.add_argument("--out", default=None,
                        help="write report.html, runs.csv, requests.csv and runs.json here")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    return parser


def load_workload(args: argparse.Namespace, session_logs: SessionLogReader) -> Workload:
    source = Path(args.source)
    if not source.is_file():
        raise ValueError(f"source={args.source!r}: no such file")
    if is_session_log(source):
        workload = session_logs.load_session_workload(source, args.session, args.model)
    else:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        workload = load_trace(source, tokenizer, args.format, args.rate, args.seed)
    if args.max_requests is not None:
        if args.max_requests < 1:
            raise ValueError(f"max_requests={args.max_requests} must be >= 1")
        workload.requests = workload.requests[:args.max_requests]
    return workload


def cost_model_for(args: argparse.Namespace, workload: Workload,
                   session_logs: SessionLogReader) -> tuple | None:
    """(the model, its source) given or in the source log; None: calibrate one per run."""
    if args.cost_model is not None:
        cost = load_step_cost(args.cost_model, session_logs)
        kind = "session log" if is_session_log(Path(args.cost_model)) else "saved model"
        return cost, CostModelSource(kind, args.cost_model, cost.num_fit_steps, cost.fit_error)
    if workload.steps:
        cost = fit_step_cost(workload.steps)
        return cost, CostModelSource("recorded steps", args.source, cost.num_fit_steps,
                                     cost.fit_error)
    return None


def run(args: argparse.Namespace, session_logs: SessionLogReader) -> list[dict]:
    workload = load_workload(args, session_logs)
    changes = [dict(parse_knob(text) for text in group) for group in args.config] or [{}]
    session = ReplaySession(workload, base_config(workload, model=args.model))
    for knobs in changes:  # every config is checked before the first run starts
        session.base.with_changes(**knobs)
    mode = "simulated" if args.simulate else "live"
    if not args.simulate:
        for flag in ("save_cost_model", "recalibrate", "against_live"):
            if getattr(args, flag):
                raise ValueError(f"{flag}: only a simulated replay (--simulate) has a cost model")
        if args.kv_offload_gb is not None:
            raise ValueError("kv_offload_gb: the what-if tier is simulated (add --simulate); "
                             "a live replay runs the real one: --config kv_offload_dir=PATH")
    if args.against_live and args.kv_offload_gb is not None:
        raise ValueError("against_live: the what-if tier (kv_offload_gb) has no live twin; "
                         "compare live against simulated without it")
    tiers = [None] if args.kv_offload_gb is None else [
        None, TierWhatIf(args.kv_offload_gb, args.kv_offload_gbps)]
    given = cost_model_for(args, workload, session_logs) if args.simulate else None
    if given is not None and args.recalibrate:
        raise ValueError(f"recalibrate: the simulation uses the {given[1].kind} "
                         f"{given[1].path}; nothing is calibrated")
    calibrations = {}  # one per set of knobs a calibration copies, --recalibrate or not
    results = []
    for index, knobs in enumerate(changes):
        def progress(done: int, total: int, index=index) -> None:
            if done == total or done % max(total // 10, 1) == 0:
                logger.info("run %d/%d: %d/%d requests", index + 1, len(changes), done, total)

        if args.simulate:
            config = session.base.with_changes(**knobs)
            copied = tuple(getattr(config, name) for name in COPIED_KNOBS)
            if given is None and copied not in calibrations:
                calibrations[copied] = self_calibrated_cost(config, session.model_runner,
                                                            args.recalibrate)
            session.cost_model, session.cost_model_source = given or calibrations[copied]
            logger.info("step-cost model: %s", session.cost_model_source.describe())
        results.extend(session.run(knobs, mode, args.speed, progress, tier) for tier in tiers)
    # Against live: the live twins follow the simulated runs, in the same config order.
    pairs = [(session.run(knobs, "live", args.speed), simulated)
             for knobs, simulated in zip(changes, list(results))] if args.against_live else []
    results += [live for live, _ in pairs]
    if args.out is not None:
        write_report(results, args.out, f"kvscope replay of {workload.name}",
                     {"divergence.csv": divergence_csv(pairs)} if pairs else None)
    if args.save_cost_model is not None:
        Path(args.save_cost_model).write_text(session.cost_model.to_json())
    rows = summaries(results)
    for row, (live, simulated) in zip(rows, pairs):
        divergence = first_divergence(live, simulated)
        row["first_divergence"] = None if divergence is None else dataclasses.asdict(divergence)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'run':<40} " + " ".join(f"{c:>16}" for c in TABLE_COLUMNS))
    for row in rows:
        cells = (f"{row[c]:>16.4g}" if isinstance(row[c], float) else f"{row[c]!s:>16}"
                 for c in TABLE_COLUMNS)
        print(f"{row['label'] + ' (' + row['mode'] + ')':<40} " + " ".join(cells))
    for line in cost_model_lines(rows):
        print(line)
    for index, row in enumerate(rows):
        if "first_divergence" in row:
            divergence = row["first_divergence"]
            print(f"run {index + 1} against run {index + 1 + len(rows) // 2} (live): " + (
                "the same pool every step" if divergence is None else
                f"first divergence at step {divergence['step']} ({divergence['what']}): "
                f"{divergence['cause']}"))


def main(argv: list[str] | None, session_logs: SessionLogReader) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rows = run(args, session_logs)
    except ValueError as error:  # bad input names its file, line, field or knob
        parser.error(str(error))
    if args.json:
        print(json.dumps(rows))
    else:
        print_table(rows)
