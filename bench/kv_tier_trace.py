"""The disk tier on a trace whose working set is 8x the pool: prefix hit rate and throughput
with and without the tier, live, and what the replay's simulator predicted for both.

The trace: --prompts distinct prefixes of --prefix-tokens tokens, each asked --rounds times
in turn (every request its prefix plus --question-tokens tokens of its own), all arriving at
once; the pool (num_gpu_blocks_override) holds 1/--working-set-ratio of the prefixes'
blocks, so LRU has evicted a prefix before it comes back. Run through `kvscope replay`'s
loop on the default model (weights loaded once):
  without tier    prefix caching only
  with tier       --kv-offload-dir (a temporary folder) of --tier-gb GiB
  simulated       the same two runs on the simulator (engine/replay/simulated_tier.py for
                  the tier), clocked by a step-cost model fitted to the live run without
                  the tier
Throughput is prompt and output tokens over the makespan (submit of the first request to
the last one's end). Prints JSON.

    flock /work/bench.lock python bench/kv_tier_trace.py
    python bench/kv_tier_trace.py --prompts 8 --prefix-tokens 128   # a quick check
"""

import argparse
import json
import os
import random
import sys
import tempfile

from roofline import cpu_name

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.replay.cost_model import fit_step_cost  # noqa: E402
from kvscope.engine.replay.metrics import RunResult  # noqa: E402
from kvscope.engine.replay.runner import ReplaySession  # noqa: E402
from kvscope.engine.replay.simulated_tier import TierWhatIf  # noqa: E402
from kvscope.engine.replay.workload import ReplayRequest, Workload  # noqa: E402
from kvscope.engine.telemetry.records import TIER_STEP_FIELDS  # noqa: E402
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--working-set-ratio", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tier-gb", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return parser.parse_args(argv)


def trace(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, min(vocab, 30000)) for _ in range(count)]

    prefixes = [tokens(args.prefix_tokens) for _ in range(args.prompts)]
    requests = [ReplayRequest(f"r{turn}-p{index}", 0.0,
                              prefix + tokens(args.question_tokens), args.output_tokens)
                for turn in range(args.rounds) for index, prefix in enumerate(prefixes)]
    return Workload("prefixes 8x the pool", requests)


def figures(run: RunResult, num_prompt_tokens: int) -> dict:
    summary = run.summary()
    tier = {name: sum(values) for name, values in zip(
        TIER_STEP_FIELDS, zip(*(r.kv_tier for r in run.records if r.kv_tier)))}
    makespan = summary["makespan_s"]
    return {
        "prefix_hit_rate": round(summary["prefix_hit_rate"], 4),
        "tokens_per_s": round((num_prompt_tokens + summary["num_output_tokens"]) / makespan, 1),
        "makespan_s": round(makespan, 3),
        "ttft_p50_s": round(summary["ttft_p50_s"], 3),
        "ttft_p99_s": round(summary["ttft_p99_s"], 3),
        "tier_hit_tokens": tier.get("hit_tokens"), "tier_loads": tier.get("loads"),
        "tier_bytes_loaded": tier.get("bytes_loaded"),
        # What the scheduler decided: a simulation given the same trace should match live.
        "steps": len(run.records),
        "scheduled_tokens": sum(record.num_scheduled_tokens for record in run.records),
        "wall_s": round(run.wall_s, 2),
    }


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_blocks = -(-(args.prefix_tokens + args.question_tokens + args.output_tokens)
                      // args.block_size)
    working_set = args.prompts * (args.prefix_tokens // args.block_size)
    num_blocks = max(working_set // args.working_set_ratio, prompt_blocks)
    base = EngineConfig(block_size=args.block_size, num_gpu_blocks_override=num_blocks,
                        max_model_len=prompt_blocks * args.block_size)
    model_path = resolve_model_path(None)
    session = ReplaySession(trace(args, len(load_tokenizer(model_path))), base)
    with tempfile.TemporaryDirectory(prefix="kv-tier-trace-") as folder:
        num_prompt_tokens = sum(len(r.prompt_token_ids) for r in session.workload.requests)
        tier_knobs = {"kv_offload_dir": folder, "kv_offload_gb": args.tier_gb}
        live = {"without_tier": session.run({}), "with_tier": session.run(tier_knobs)}
    calibration = live["without_tier"]
    session.cost_model = fit_step_cost(calibration.records)
    simulated = {"without_tier": session.run({}, "simulated"),
                 "with_tier": session.run({}, "simulated", tier=TierWhatIf(args.tier_gb))}
    results = {
        "cpu": cpu_name(), "threads": torch.get_num_threads(),
        "model": model_path.name,
        "trace": {"requests": len(session.workload.requests), "prompts": args.prompts,
                  "rounds": args.rounds, "prefix_tokens": args.prefix_tokens,
                  "question_tokens": args.question_tokens, "output_tokens": args.output_tokens,
                  "block_size": args.block_size, "pool_blocks": num_blocks,
                  "working_set_blocks": working_set,
                  "working_set_over_pool": round(working_set / num_blocks, 2),
                  "tier_gb": args.tier_gb},
        # The simulated clock: how well the model reproduces the run it was fitted to.
        "cost_model": {"fit_error": round(session.cost_model.fit_error, 3),
                       "fitted_run_s": round(sum(s.duration_s for s in calibration.steps), 3),
                       "its_prediction_s": round(sum(session.cost_model.step_time(record)
                                                     for record in calibration.records), 3)},
        "live": {name: figures(run, num_prompt_tokens) for name, run in live.items()},
        "simulated": {name: figures(run, num_prompt_tokens) for name, run in simulated.items()},
    }
    for mode in ("live", "simulated"):
        runs = results[mode]
        runs["tier_throughput_gain"] = round(runs["with_tier"]["tokens_per_s"]
                                             / runs["without_tier"]["tokens_per_s"], 2)
    print(json.dumps(results, indent=1))
    print(json.dumps({mode: results[mode]["tier_throughput_gain"]
                      for mode in ("live", "simulated")}), file=sys.stderr)


if __name__ == "__main__":
    main()
