"""What-if replay: how fast the simulator runs, and how close it comes to the live engine.

Part 1, speed: a Mooncake-style trace of --sim-requests requests (prompts built from shared
512-token blocks, as the Mooncake trace's hash ids say) replayed simulated on a pool of
--sim-blocks blocks (num_gpu_blocks_override: a GPU-sized pool), at GPU-like knobs. Reported:
the replay's wall seconds (target <= 30 s for 10,000 requests on 1,000,000 blocks) and what
it simulated.

Part 2, error: a calibration trace run live fits the step-cost model (its own step times);
then a different trace of --error-requests requests runs live and simulated under the same
config, and the relative error of the simulation's TTFT p50, TTFT p99, throughput and mean
KV usage against live is reported (target <= 15 % on TTFT p50 and throughput). The same
trace is simulated again on a self-calibrated cost model (engine/replay/calibration.py: a
short live profile of synthetic steps, what `kvscope replay TRACE --simulate` uses when no
--cost-model is given), calibrated afresh under the same config and threads: its
calibration seconds (target <= 30 s on the default model on 2 cores) and the same relative
errors are reported.

Usage (run under `flock /work/bench.lock`; part 2 runs the default model for real):
  python bench/replay.py                       # both parts
  python bench/replay.py --part speed          # the simulator only (no weights)
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.replay.calibration import self_calibrated_cost  # noqa: E402
from kvscope.engine.replay.cost_model import StepCost, fit_step_cost  # noqa: E402
from kvscope.engine.replay.runner import ReplaySession  # noqa: E402
from kvscope.engine.replay.traces import MOONCAKE_BLOCK_TOKENS, load_trace  # noqa: E402
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("speed", "error", "all"), default="all")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--sim-requests", type=int, default=10_000)
    parser.add_argument("--sim-blocks", type=int, default=1_000_000)
    parser.add_argument("--error-requests", type=int, default=200)
    parser.add_argument("--calibration-requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.0,
                        help="part 2: Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="part 2: torch threads; on a shared CPU one thread's step times "
                        "vary least from run to run, which the fitted model relies on")
    return parser.parse_args(argv)


def mooncake_trace(path: Path, num_requests: int, rate: float, input_range: tuple[int, int],
                   output_range: tuple[int, int], num_prefixes: int, seed: int) -> Path:
    """Requests in conversations: each shares its first hash ids (a system prompt and the
    turns before it) with others of its prefix group, then has blocks of its own."""
    rng = random.Random(seed)
    now, next_id, lines = 0.0, num_prefixes * 8, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        length = rng.randint(*input_range)
        blocks = -(-length // MOONCAKE_BLOCK_TOKENS)
        group = rng.randrange(num_prefixes)
        shared = rng.randint(0, blocks - 1)
        hash_ids = [group * 8 + i for i in range(min(shared, 8))]
        while len(hash_ids) < blocks:
            hash_ids.append(next_id)
            next_id += 1
        lines.append(json.dumps({"timestamp": int(now * 1000), "input_length": length,
                                 "output_length": rng.randint(*output_range),
                                 "hash_ids": hash_ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def speed(args, folder: Path) -> dict:
    """Simulated replay at GPU scale; the cost model is an A100-like 135M-model step."""
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    trace = mooncake_trace(folder / "speed.jsonl", args.sim_requests, 50.0, (128, 4096),
                           (16, 256), 200, args.seed)
    started = time.perf_counter()
    workload = load_trace(trace, tokenizer)
    import_s = time.perf_counter() - started
    gpu_step = StepCost(0.004, 2e-6, 5e-6, 1e-8)
    config = EngineConfig(model=args.model, num_gpu_blocks_override=args.sim_blocks,
                          max_num_seqs=256, max_num_batched_tokens=8192)
    cpu_started = time.process_time()
    result = ReplaySession(workload, config, gpu_step).run({}, "simulated")
    cpu_s = time.process_time() - cpu_started
    summary = result.summary()
    return {"requests": args.sim_requests, "blocks": result.num_blocks,
            "import_s": round(import_s, 2), "replay_wall_s": round(result.wall_s, 2),
            "replay_cpu_s": round(cpu_s, 2),
            "target_s": 30, "steps": summary["num_steps"],
            "output_tokens": summary["num_output_tokens"],
            "prefix_hit_rate": round(summary["prefix_hit_rate"], 3),
            "peak_kv_usage": round(summary["peak_kv_usage"], 4),
            "simulated_makespan_s": round(summary["makespan_s"], 1)}


def error(args, folder: Path) -> dict:
    """Live vs simulated on the default model, with a cost model fitted to another trace."""
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    shape = {"input_range": (32, 512), "output_range": (8, 48), "num_prefixes": 6}
    calibration = load_trace(mooncake_trace(folder / "calibration.jsonl",
                                            args.calibration_requests, args.rate,
                                            seed=args.seed + 1, **shape), tokenizer)
    target = load_trace(mooncake_trace(folder / "target.jsonl", args.error_requests,
                                       args.rate, seed=args.seed, **shape), tokenizer)
    # A 512-token budget: many short steps, as a served CPU engine runs them.
    config = EngineConfig(model=args.model, max_model_len=2048, max_num_batched_tokens=512)
    session = ReplaySession(calibration, config)
    fitted = session.run({}, "live")
    cost = fit_step_cost(fitted.records, [s.duration_s for s in fitted.steps])
    session.workload = target
    live_run = session.run({}, "live")
    live = live_run.summary()
    session.cost_model = cost
    simulated = session.run({}, "simulated").summary()
    session.cost_model, source = self_calibrated_cost(config, session.model_runner,
                                                      recalibrate=True)
    self_simulated = session.run({}, "simulated").summary()
    keys = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s", "mean_kv_usage",
            "peak_kv_usage")

    def against_live(summary: dict) -> dict:
        return {k: abs(summary[k] - live[k]) / live[k] for k in keys if live[k]}

    def step_errors(model: StepCost) -> dict:
        """The model's prediction for each step the live run took, against its time:
        the mean relative error, and predicted over measured seconds in all."""
        predicted = [model.step_time(record) for record in live_run.records]
        measured = [sample.duration_s for sample in live_run.steps]
        return {"mean_step_error": sum(abs(p - m) / m for p, m in zip(predicted, measured))
                / len(measured), "predicted_over_live_seconds": sum(predicted) / sum(measured)}

    columns = (*keys, "num_steps", "preemptions", "wall_s")
    return {"requests": args.error_requests, "calibration_requests": args.calibration_requests,
            "threads": args.threads,
            "cost_model": {k: v for k, v in json.loads(cost.to_json()).items()},
            "live": {k: live[k] for k in columns},
            "simulated": {k: simulated[k] for k in columns},
            "relative_error": against_live(simulated), "live_steps": step_errors(cost),
            "self_calibrated": {
                "calibration_s": round(source.calibration_s, 2),
                "calibration_steps": source.num_steps, "fit_error": source.fit_error,
                "calibration_target_s": 30, "cost_model": json.loads(session.cost_model.to_json()),
                "simulated": {k: self_simulated[k] for k in columns},
                "relative_error": against_live(self_simulated),
                "live_steps": step_errors(session.cost_model)},
            "target": 0.15}


def main(argv=None) -> None:
    args = parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        if args.part in ("error", "all"):
            report["error"] = error(args, Path(folder))
            print(json.dumps(report["error"]), file=sys.stderr)
        if args.part in ("speed", "all"):
            report["speed"] = speed(args, Path(folder))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
