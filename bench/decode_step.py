"""Where a decode step's time goes: a batch of sequences decoding together, profiled.

Prefills --batch prompts of --prompt-len random tokens, then times --steps decode steps
(engine.step(): scheduling, inputs, the forward, sampling, outputs) and profiles a few more
with torch.profiler, as it profiles the prefill. Prints JSON: the mean step, the forward's
share, the attention's share (store_kv + paged_attention, whichever backend runs them), the
top ops by self time, and the split the machine's limits are read against: the GEMMs'
GFLOP/s (the model's matmul FLOPs over the linears' own time) as a share of the large-GEMM
rate in the model's dtype measured in the same run (bench/gemm_rate.py), for the decode
steps and the prefill; the attention's K/V bytes/s as a share of the read bandwidth measured
in the run; and the step's time outside every op (the Python around the forward).

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

import roofline
import torch
from common import add_model_args, ordinary_token_ids, random_prompt, setup
from gemm_rate import large_gemm_flops
from phase_profile import ATTENTION_OPS, GEMM_OPS, self_seconds
from torch.profiler import ProfilerActivity, profile, record_function

from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import kv_quant

ATTENTION_LABEL = "attention (store_kv + paged_attention)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(kv_quant.CODE_DTYPES))
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
    engine = bench.engine(max_num_seqs=max(args.batch, 1), kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(args.seed)
    vocab = ordinary_token_ids(bench.runner)
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 32, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(random_prompt(rng, vocab, args.prompt_len), params)
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prefill_profile:
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
    context_tokens = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
    events = prof.key_averages()
    totals = {e.key: e.cpu_time_total for e in events}
    step_total = totals.get("step", 0.0) or 1.0
    # The one-call decoder stack traces its ops under their own names instead.
    attention_total = (totals.get("kvscope::paged_attention", 0.0)
                       + totals.get("kvscope::store_kv", 0.0)
                       if bench.runner.fused_decoder_stack else totals.get(ATTENTION_LABEL, 0.0))
    forward_total = sum(t for k, t in totals.items() if k.startswith("## forward"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    split = limits_split(bench, args, events, prefill_profile.key_averages(), context_tokens)
    print(json.dumps({
        **bench.describe(), "attention_backend": bench.runner.kernel_ops.backend,
        "batch": args.batch, "prompt_len": args.prompt_len, "kv_cache_dtype": args.kv_cache_dtype,
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
        **split,
    }, indent=2))


def limits_split(bench, args, events, prefill_events, context_tokens: int) -> dict:
    """Decode steps and prefill against the machine's limits, measured now: GEMM FLOP/s
    over the linears' own time, attention's K/V bytes/s over its own time."""
    runner = bench.runner
    costs = roofline.model_costs(runner.hf_config, runner.dtype)
    large = large_gemm_flops(runner.dtype)
    bandwidth = roofline.read_bandwidth(huge=True)
    steps = args.profile_steps
    gemm = self_seconds(events, GEMM_OPS) / steps
    attention = self_seconds(events, ATTENTION_OPS) / steps
    python = self_seconds(events, ("step",)) / steps
    # Each step reads every cached token's K and V rows (codes and scale, in a quantized
    # cache) in every layer once.
    cache_dtype = kv_quant.cache_dtype(args.kv_cache_dtype, runner.dtype)
    kv_bytes = context_tokens * cache_dtype.itemsize * sum(
        2 * layer.num_kv_heads * kv_quant.row_width(layer.head_dim, cache_dtype)
        for layer in runner.attention_layers)
    decode_flops = args.batch * costs["matmul_flops_per_token"]
    # A prefill's layers run over every prompt token, the output projection only for each
    # sequence's last token.
    head_flops = 2 * runner.hf_config.vocab_size * runner.hf_config.hidden_size
    prefill_flops = args.batch * (args.prompt_len * (costs["matmul_flops_per_token"] - head_flops)
                                  + head_flops)
    prefill_gemm = self_seconds(prefill_events, GEMM_OPS)
    return {
        "large_gemm_gflop_s": round(large / 1e9, 1),
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "decode_split_ms_per_step": {"gemm": round(gemm * 1e3, 2),
                                     "attention": round(attention * 1e3, 2),
                                     "python_outside_ops": round(python * 1e3, 2)},
        "decode_gemm_gflop_s": round(decode_flops / gemm / 1e9, 1),
        "decode_gemm_share_of_large": round(decode_flops / gemm / large, 3),
        "decode_attention_gb_s": round(kv_bytes / attention / 1e9, 2),
        "decode_attention_share_of_bandwidth": round(kv_bytes / attention / bandwidth, 3),
        "prefill_gemm_seconds": round(prefill_gemm, 3),
        "prefill_gemm_gflop_s": round(prefill_flops / prefill_gemm / 1e9, 1),
        "prefill_gemm_share_of_large": round(prefill_flops / prefill_gemm / large, 3),
    }


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
