"""Where a decode step's time goes: a batch of sequences decoding together, profiled.

Prefills --batch prompts of --prompt-len random tokens, then times --steps decode steps
(engine.step(): scheduling, inputs, the forward, sampling, outputs) and profiles a few more
with torch.profiler. Prints JSON: the mean step, the forward's share, the attention's share
(store_kv + paged_attention, whichever backend runs them) and the top ops by self time.

Usage:
  python bench/decode_step.py                        # 64 sequences of ~300 tokens
  python bench/decode_step.py --batch 1 --prompt-len 128
"""

import argparse
import json
import os
import random
import time
from dataclasses import replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from common import add_model_args, ordinary_token_ids, random_prompt, setup
from torch.profiler import ProfilerActivity, profile, record_function

from kvscope.engine.sample.sampling_params import SamplingParams

ATTENTION_LABEL = "attention (store_kv + paged_attention)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    return parser.parse_args(argv)


def label_attention(runner) -> None:
    """Wrap every layer's attention ops in one profiler range, so eager torch ops and a
    C++ op alike count as attention."""
    ops = runner.kernel_ops

    def labelled(function):
        def call(*args, **kwargs):
            with record_function(ATTENTION_LABEL):
                return function(*args, **kwargs)
        return call

    wrapped = replace(ops, paged_attention=labelled(ops.paged_attention),
                      store_kv=labelled(ops.store_kv))
    for layer in runner.attention_layers:
        layer.ops = wrapped


def main(argv=None) -> None:
    args = parse_args(argv)
    bench = setup(args, max_model_len=args.prompt_len + 64 + args.steps * 2 + 64)
    engine = bench.engine(max_num_seqs=max(args.batch, 1))
    rng = random.Random(args.seed)
    vocab = ordinary_token_ids(bench.runner)
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 32, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(random_prompt(rng, vocab, args.prompt_len), params)
    started = time.perf_counter()
    while engine.scheduler.waiting or any(seq.num_computed_tokens < args.prompt_len
                                          for seq in engine.scheduler.running):
        engine.step()
    prefill_seconds = time.perf_counter() - started
    engine.step()  # the first all-decode step
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    step = sorted(times)[len(times) // 2]
    label_attention(bench.runner)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            with record_function("step"):
                engine.step()
    events = prof.key_averages()
    totals = {e.key: e.cpu_time_total for e in events}
    step_total = totals.get("step", 0.0) or 1.0
    # The one-call decoder stack traces its ops under their own names instead.
    attention_total = (totals.get("kvscope::paged_attention", 0.0)
                       + totals.get("kvscope::store_kv", 0.0)
                       if bench.runner.fused_decoder_stack else totals.get(ATTENTION_LABEL, 0.0))
    forward_total = sum(t for k, t in totals.items() if k.startswith("## forward"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    print(json.dumps({
        **bench.describe(), "attention_backend": bench.runner.kernel_ops.backend,
        "batch": args.batch, "prompt_len": args.prompt_len,
        "prefill_seconds": round(prefill_seconds, 2),
        "decode_step_ms_median": round(step * 1e3, 2),
        "decode_tokens_per_s": round(args.batch / step, 1),
        "profiled_step_ms": round(step_total / args.profile_steps / 1e3, 2),
        "forward": ("one-call decoder stack" if bench.runner.fused_decoder_stack
                    else "eager layers"),
        "attention_share_of_step": round(attention_total / step_total, 3),
        "forward_share_of_step": round(forward_total / step_total, 3) if forward_total else None,
        "top_ops_self_ms_per_step": {e.key: round(e.self_cpu_time_total / args.profile_steps
                                                  / 1e3, 2) for e in top},
    }, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
