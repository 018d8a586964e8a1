"""Mixed traffic: a few 2,000-token prompts among many short chats arriving over time, with
chunked prefill off and on, and the same traffic in a pool at 25 % of its need.

Requests arrive between engine steps (arrival times are step indexes, so every
configuration sees the same arrival pattern): a short chat every --arrival-interval steps,
the long prompts spread evenly over the same span, each arriving with --burst short ones.
Reported per configuration: the short requests' time to first token (p50 / p99, in
seconds and in steps after arrival), the long ones' TTFT p50, the longest single step (the
stall a whole long prefill causes), total time and throughput (output tokens / s and all
tokens / s).

Configurations:
  chunked_off            the whole prompt in one step (budget = max_model_len)
  chunked_on             chunks under --max-num-batched-tokens, the engine's fair default:
                         while requests wait, a running prefill takes at most a quarter
                         of the budget
  chunked_on_uncapped    long_prefill_token_threshold=0: a running prefill is served
                         first, so it can take a step's whole budget
  chunked_on_threshold   no prefill chunk over --long-prefill-token-threshold, waiting
                         requests or not (vLLM's knob)

Memory pressure: num_gpu_blocks_override at --pressure-fraction of the most blocks the
uncontended chunked_on run held at once (but at least one max_model_len sequence, the
engine's minimum), chunked on, in both preemption modes: throughput, preemptions,
prefill tokens computed (recompute redoes work), swap traffic (SwapStats, and bytes), and
whether every output still equals the uncontended run's.

Usage (the defaults take about 5 minutes on an idle 2-core CPU in float32):
  python bench/mixed.py
  python bench/mixed.py --threads 1 --num-long 2 --long-tokens 1000 --num-short 12 \
      --arrival-interval 1 --short-max-tokens 8 --long-max-tokens 4 \
      --max-num-batched-tokens 256                                     # a quick check
"""

import argparse
import json
import math
import random

from common import add_model_args, drive, ordinary_token_ids, percentile, random_prompt, ratio, rounded, setup

from kvscope.engine.sampling_params import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--long-max-tokens", type=int, default=16)
    parser.add_argument("--num-short", type=int, default=32)
    parser.add_argument("--short-tokens", type=int, nargs=2, default=[32, 128],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--short-max-tokens", type=int, default=32)
    parser.add_argument("--arrival-interval", type=int, default=2,
                        help="steps between two short requests' arrivals")
    parser.add_argument("--burst", type=int, default=4,
                        help="short requests arriving in the same step as each long one")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=128)
    parser.add_argument("--pressure-fraction", type=float, default=0.25)
    parser.add_argument("--skip-pressure", action="store_true")
    return parser.parse_args(argv)


def make_arrivals(args, vocab) -> tuple[list[tuple[int, list[int], SamplingParams]], set[int]]:
    """(arrival step, prompt, params) for every request, in arrival order; and the indexes
    of the long ones. Each long prompt arrives together with --burst short ones, queued
    ahead of them: a short request that arrives during a long step would wait just as long
    in wall-clock time, but with arrivals counted in steps only these show the wait."""
    rng = random.Random(args.seed)
    short = SamplingParams(temperature=0, max_tokens=args.short_max_tokens, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=args.long_max_tokens, ignore_eos=True)
    short_steps = [i * args.arrival_interval for i in range(args.num_short)]
    long_steps = []
    for j in range(args.num_long):
        first = j * args.num_short // max(args.num_long, 1)
        if first < args.num_short:
            for index in range(first, min(first + args.burst, args.num_short)):
                short_steps[index] = short_steps[first]
        long_steps.append(short_steps[first] if first < args.num_short else 0)
    # (step, 0 for long / 1 for short: a long one is queued first, prompt, params)
    arrivals = [(step, 0, random_prompt(rng, vocab, args.long_tokens), long)
                for step in long_steps]
    arrivals += [(step, 1, random_prompt(rng, vocab, rng.randint(*args.short_tokens)), short)
                 for step in short_steps]
    arrivals.sort(key=lambda a: (a[0], a[1]))
    long_indexes = {i for i, arrival in enumerate(arrivals) if arrival[1] == 0}
    return [(step, prompt, params) for step, _, prompt, params in arrivals], long_indexes


def summarize(run, arrivals, long_indexes) -> dict:
    """Request ids are assigned in arrival order (req-0, req-1, ... of this engine)."""
    ids = sorted(run.outputs, key=lambda rid: int(rid.rsplit("-", 1)[1]))
    short_ids = [rid for i, rid in enumerate(ids) if i not in long_indexes]
    long_ids = [rid for i, rid in enumerate(ids) if i in long_indexes]
    first_step = run.first_token_step()
    short_steps = [first_step[rid] - run.arrival_step[rid] for rid in short_ids]
    short_ttft, long_ttft = run.ttft(short_ids), run.ttft(long_ids)
    prompt_tokens = sum(len(p) for _, p, _ in arrivals)
    return {
        "short_ttft_p50_s": rounded(percentile(short_ttft, 50)),
        "short_ttft_p99_s": rounded(percentile(short_ttft, 99)),
        "short_ttft_steps_p50": percentile(short_steps, 50),
        "short_ttft_steps_p99": percentile(short_steps, 99),
        "long_ttft_p50_s": rounded(percentile(long_ttft, 50)),
        "longest_step_s": round(max(r.duration for r in run.records), 3),
        "total_s": round(run.seconds, 2),
        "steps": len(run.records),
        "output_tokens": run.output_tokens,
        "output_tokens_per_s": round(run.output_tokens / run.seconds, 2),
        "all_tokens_per_s": round((run.output_tokens + prompt_tokens) / run.seconds, 2),
        "prefill_tokens_computed": run.prefill_tokens,
        "num_preemptions": sum(len(r.preempted) for r in run.records),
    }


def token_ids(run) -> list[list[int]]:
    ids = sorted(run.outputs, key=lambda rid: int(rid.rsplit("-", 1)[1]))
    return [run.outputs[rid].outputs[0].token_ids for rid in ids]


def main(argv=None) -> None:
    args = parse_args(argv)
    max_model_len = max(args.long_tokens + args.long_max_tokens,
                        args.short_tokens[1] + args.short_max_tokens) + 1
    bench = setup(args, max_model_len)
    arrivals, long_indexes = make_arrivals(args, ordinary_token_ids(bench.runner))
    budget = args.max_num_batched_tokens
    configs = {
        "chunked_off": {"enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len},
        "chunked_on": {"max_num_batched_tokens": budget},
        "chunked_on_uncapped": {"max_num_batched_tokens": budget,
                                "long_prefill_token_threshold": 0},
        "chunked_on_threshold": {"max_num_batched_tokens": budget,
                                 "long_prefill_token_threshold":
                                     args.long_prefill_token_threshold},
    }
    report = {**bench.describe(), "args": vars(args), "max_model_len": max_model_len,
              "workload": {"requests": len(arrivals), "long": len(long_indexes),
                           "prompt_tokens": sum(len(p) for _, p, _ in arrivals)},
              "chunked_prefill": {}}
    runs = {}
    for name, knobs in configs.items():
        # Caching off: the random prompts share nothing, and reruns must not hit.
        engine = bench.engine(enable_prefix_caching=False, **knobs)
        runs[name] = drive(engine, arrivals)
        report["chunked_prefill"][name] = {**knobs, **summarize(runs[name], arrivals,
                                                                  long_indexes)}
    results = report["chunked_prefill"]
    off = results["chunked_off"]
    report["chunked_prefill"]["ratios_off_over_on"] = {
        name: {"short_ttft_p50": ratio(off["short_ttft_p50_s"], results[name]["short_ttft_p50_s"]),
               "short_ttft_p99": ratio(off["short_ttft_p99_s"], results[name]["short_ttft_p99_s"]),
               "throughput": ratio(off["output_tokens_per_s"],
                                   results[name]["output_tokens_per_s"])}
        for name in ("chunked_on", "chunked_on_uncapped", "chunked_on_threshold")}

    if not args.skip_pressure:
        block_size = runs["chunked_on"].engine.config.block_size
        # The workload's need: the most blocks the uncontended run held at once.
        need = max(r.num_used_blocks for r in runs["chunked_on"].records)
        num_blocks = max(math.ceil(need * args.pressure_fraction),
                         math.ceil(max_model_len / block_size))  # the engine's minimum
        reference = token_ids(runs["chunked_on"])
        pressure = {"peak_blocks_uncontended": need, "num_gpu_blocks_override": num_blocks,
                    "fraction_of_need": round(num_blocks / need, 3),
                    "uncontended": {"output_tokens_per_s":
                                    results["chunked_on"]["output_tokens_per_s"]}}
        for mode in ("recompute", "swap"):
            engine = bench.engine(enable_prefix_caching=False, max_num_batched_tokens=budget,
                                  num_gpu_blocks_override=num_blocks, preemption_mode=mode)
            run = drive(engine, arrivals)
            blocks_out = sum(r.num_blocks_swapped_out for r in run.records)
            blocks_in = sum(r.num_blocks_swapped_in for r in run.records)
            bytes_per_block = engine.memory_plan.bytes_per_block
            pressure[mode] = {
                **summarize(run, arrivals, long_indexes),
                "outputs_match_uncontended": token_ids(run) == reference,
                "swap": {"swap_outs": sum(len(r.swapped_out) for r in run.records),
                         "swap_ins": sum(len(r.swapped_in) for r in run.records),
                         "blocks_out": blocks_out, "blocks_in": blocks_in,
                         "bytes_out": blocks_out * bytes_per_block,
                         "bytes_in": blocks_in * bytes_per_block},
                "blocks_in_use_at_end": run.records[-1].num_used_blocks,
            }
            pressure[mode]["throughput_vs_uncontended"] = ratio(
                pressure[mode]["output_tokens_per_s"], results["chunked_on"]["output_tokens_per_s"])
        report["memory_pressure"] = pressure
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
