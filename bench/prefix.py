"""Prefix caching and block sharing: a shared system prompt with the cache on and off, and
the memory that parallel sampling (n = 4) and beam search (width 4) save by sharing blocks.

Part 1, shared system prompt: every request is one system prompt (1,000 tokens) followed by
a short question; a question arrives every --arrival-interval steps (as at a chat server;
0 = all at once, in which case the requests admitted in the very first step cannot hit
each other's blocks yet). With the cache on, the system prompt's blocks are computed once
and every later request reuses them. Reported per mode: prefill tokens
computed (the prefill chunks of the step records), time to first token p50 / p99, total
time, and the on / off ratios.

Part 2, sharing: prompts sampled n = 4 ways, and searched with 4 beams. After every step a
telemetry snapshot gives blocks_saved_by_sharing (blocks the live sequences hold in their
tables minus the physical blocks in use) and the blocks held without sharing; the fraction
saved is reported at its peak, as a mean over steps and as a block-weighted mean (sum of
saved / sum of held), next to the vLLM paper's figures (6.1-9.8 % for parallel sampling and
37.6-55.2 % for beam search, on Alpaca-like workloads).

Usage (the defaults take about 5 minutes on an idle 2-core CPU in float32):
  python bench/prefix.py                                      # the defaults above
  python bench/prefix.py --threads 1 --num-questions 12 --max-tokens 8 \
      --sharing-prompts 4 --sharing-max-tokens 32             # a quick check
"""

import argparse
import json
import random

from common import add_model_args, drive, ordinary_token_ids, percentile, random_prompt, ratio, rounded, setup

from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_recorder import mirror_of

PAPER_SAVINGS = {"parallel_sampling": [0.061, 0.098], "beam_search": [0.376, 0.552]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, nargs=2, default=[8, 32],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--arrival-interval", type=int, default=1,
                        help="steps between two questions' arrivals (0: all at once)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--sharing-prompts", type=int, default=8)
    parser.add_argument("--sharing-prompt-tokens", type=int, nargs=2, default=[16, 128],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--sharing-max-tokens", type=int, default=64,
                        help="tokens per sample / beam in part 2")
    parser.add_argument("--width", type=int, default=4, help="n and beam width of part 2")
    parser.add_argument("--skip-sharing", action="store_true")
    return parser.parse_args(argv)


def shared_system_prompt(bench, args, vocab) -> dict:
    rng = random.Random(args.seed)
    system = random_prompt(rng, vocab, args.system_tokens)
    prompts = [system + random_prompt(rng, vocab, rng.randint(*args.question_tokens))
               for _ in range(args.num_questions)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = bench.engine(enable_prefix_caching=caching,
                              max_num_batched_tokens=args.max_num_batched_tokens)
        run = drive(engine, [(i * args.arrival_interval, prompt, params)
                             for i, prompt in enumerate(prompts)])
        ttft = run.ttft()
        queries = sum(r.prefix_cache_queries for r in run.records)
        hits = sum(r.prefix_cache_hits for r in run.records)
        results["caching_on" if caching else "caching_off"] = {
            "prefill_tokens_computed": run.prefill_tokens,
            "prompt_tokens": sum(map(len, prompts)),
            "cached_tokens_reported": sum(o.num_cached_tokens for o in run.outputs.values()),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "ttft_p50_s": rounded(percentile(ttft, 50)),
            "ttft_p99_s": rounded(percentile(ttft, 99)),
            "total_s": round(run.seconds, 2),
            "steps": len(run.records),
            "output_tokens": run.output_tokens,
            "num_preemptions": sum(len(r.preempted) for r in run.records),
            "num_blocks": engine.memory_plan.num_blocks,
        }
    on, off = results["caching_on"], results["caching_off"]
    results["ratios_off_over_on"] = {
        "prefill_tokens_computed": ratio(off["prefill_tokens_computed"],
                                         on["prefill_tokens_computed"]),
        "ttft_p50": ratio(off["ttft_p50_s"], on["ttft_p50_s"]),
        "ttft_p99": ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
        "total_time": ratio(off["total_s"], on["total_s"]),
    }
    return results


def sharing_savings(bench, args, vocab, kind: str) -> dict:
    rng = random.Random(args.seed + 1)
    prompts = [random_prompt(rng, vocab, rng.randint(*args.sharing_prompt_tokens))
               for _ in range(args.sharing_prompts)]
    if kind == "parallel_sampling":
        params = SamplingParams(n=args.width, temperature=1.0, seed=args.seed,
                                max_tokens=args.sharing_max_tokens, ignore_eos=True)
    else:
        params = BeamSearchParams(args.width, args.sharing_max_tokens, ignore_eos=True)
    # No prefix cache: only the sharing inside a request (forks) is measured.
    engine = bench.engine(enable_prefix_caching=False)
    fractions, saved_total, held_total = [], 0, 0

    def measure(engine) -> None:
        nonlocal saved_total, held_total
        snapshot = mirror_of(engine)
        held = sum(len(seq.block_table) for seq in snapshot.sequences)
        if held:
            saved = snapshot.blocks_saved_by_sharing
            fractions.append(saved / held)
            saved_total += saved
            held_total += held

    run = drive(engine, [(0, prompt, params) for prompt in prompts], on_step=measure)
    low, high = PAPER_SAVINGS[kind]
    return {
        "width": args.width, "requests": len(prompts), "max_tokens": args.sharing_max_tokens,
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        "saved_fraction_peak": rounded(max(fractions, default=None), 4),
        "saved_fraction_mean_over_steps": rounded(
            sum(fractions) / len(fractions) if fractions else None, 4),
        "saved_fraction_block_weighted": rounded(saved_total / held_total if held_total
                                                 else None, 4),
        "paper_saved_fraction_range": [low, high],
        "steps": len(run.records), "total_s": round(run.seconds, 2),
        "blocks_in_use_at_end": run.records[-1].num_used_blocks,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    max_model_len = max(args.system_tokens + args.question_tokens[1] + args.max_tokens,
                        args.sharing_prompt_tokens[1] + args.sharing_max_tokens) + 1
    bench = setup(args, max_model_len)
    vocab = ordinary_token_ids(bench.runner)
    report = {**bench.describe(), "args": vars(args),
              "shared_system_prompt": shared_system_prompt(bench, args, vocab)}
    if not args.skip_sharing:
        report["sharing"] = {kind: sharing_savings(bench, args, vocab, kind)
                             for kind in ("parallel_sampling", "beam_search")}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
