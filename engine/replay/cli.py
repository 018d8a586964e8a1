"""`kvscope replay SOURCE --config KEY=VALUE ... [--config ...]`: a run per config.

kvscope's own session logs are read by the SessionLogReader the caller hands `main`
(kvscope/cli.py hands it kvscope.storage.replay_source)."""

import argparse
import json
import logging
import sys
from pathlib import Path

from kvscope.engine.replay.cost_model import fit_step_cost, load_step_cost
from kvscope.engine.replay.report import summaries, write_report
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
                        "steps, or saved as JSON (default: the source log's own steps)")
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
                   session_logs: SessionLogReader):
    if args.cost_model is not None:
        return load_step_cost(args.cost_model, session_logs)
    if workload.steps:
        return fit_step_cost(workload.steps)
    raise ValueError("cost_model: --simulate on a trace needs --cost-model (a session log "
                     "whose steps it is fitted to, or a saved model)")


def run(args: argparse.Namespace, session_logs: SessionLogReader) -> list[dict]:
    workload = load_workload(args, session_logs)
    changes = [dict(parse_knob(text) for text in group) for group in args.config] or [{}]
    session = ReplaySession(workload, base_config(workload, model=args.model))
    for knobs in changes:  # every config is checked before the first run starts
        session.base.with_changes(**knobs)
    mode = "simulated" if args.simulate else "live"
    tiers = [None]
    if args.kv_offload_gb is not None:
        if not args.simulate:
            raise ValueError("kv_offload_gb: the what-if tier is simulated (add --simulate); "
                             "a live replay runs the real one: --config kv_offload_dir=PATH")
        tiers.append(TierWhatIf(args.kv_offload_gb, args.kv_offload_gbps))
    if args.simulate:
        session.cost_model = cost_model_for(args, workload, session_logs)
        logger.info("step-cost model: %s", session.cost_model)
    elif args.save_cost_model is not None:
        raise ValueError("save_cost_model: only a simulated replay (--simulate) has one")
    results = []
    for index, knobs in enumerate(changes):
        def progress(done: int, total: int, index=index) -> None:
            if done == total or done % max(total // 10, 1) == 0:
                logger.info("run %d/%d: %d/%d requests", index + 1, len(changes), done, total)

        results.extend(session.run(knobs, mode, args.speed, progress, tier) for tier in tiers)
    if args.out is not None:
        write_report(results, args.out, f"kvscope replay of {workload.name}")
    if args.save_cost_model is not None:
        Path(args.save_cost_model).write_text(session.cost_model.to_json())
    return summaries(results)


def print_table(rows: list[dict]) -> None:
    print(f"{'run':<40} " + " ".join(f"{c:>16}" for c in TABLE_COLUMNS))
    for row in rows:
        cells = (f"{row[c]:>16.4g}" if isinstance(row[c], float) else f"{row[c]!s:>16}"
                 for c in TABLE_COLUMNS)
        print(f"{row['label'] + ' (' + row['mode'] + ')':<40} " + " ".join(cells))


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
