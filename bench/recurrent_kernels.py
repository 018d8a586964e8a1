"""The recurrent layers' kernels at Qwen3.5 shapes: the C++ CPU kernels against the plain-torch
reference (kernels/reference.py).

Decode: one step of --batch sequences through every linear-attention layer's delta rule
(each layer its own pool of fp32 states, so the step's states, --layers x batch x 2 MiB,
outrun the caches as a model's do): the state bytes read and written per second, against
this machine's read bandwidth (engine/worker/memory_bandwidth.py). The conv's decode step
rides along. Prefill: one sequence of --tokens through one layer's delta rule and conv,
tokens per second, C++ (token by token) against the reference (transformers' chunked form).
Prints JSON.

The shapes are Qwen3_5TextConfig's defaults (transformers 5.25): 16 key heads and 32 value
heads of 128, a conv of width 4 over q, k and v (8192 channels), 24 linear-attention layers
(32 layers, full attention every 4th).

Usage:
  python bench/recurrent_kernels.py
  python bench/recurrent_kernels.py --batch 1 8 --tokens 512 2048
"""

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from roofline import cpu_name

from kvscope.engine.worker.memory_bandwidth import best_seconds, read_bandwidth
from kvscope.kernels import cpu_kernels, reference

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 16, 32, 128, 4
CHANNELS = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="q/k/v and the conv's dtype (the state is fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def delta_rule_inputs(rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"q": torch.randn(rows, KEY_HEADS, HEAD_DIM).to(dtype),
            "k": torch.randn(rows, KEY_HEADS, HEAD_DIM).to(dtype),
            "v": torch.randn(rows, VALUE_HEADS, HEAD_DIM).to(dtype),
            "g": -torch.rand(rows, VALUE_HEADS), "beta": torch.rand(rows, VALUE_HEADS)}


def decode(ops, batch: int, layers: int, dtype: torch.dtype, repeats: int) -> dict:
    """One decode step of every layer: the delta rule's state bytes moved per second."""
    pools = [torch.zeros(batch, VALUE_HEADS, HEAD_DIM, HEAD_DIM) for _ in range(layers)]
    windows = [torch.zeros(batch, CHANNELS, CONV_WIDTH - 1, dtype=dtype) for _ in range(layers)]
    inputs, slots = delta_rule_inputs(batch, dtype), torch.arange(batch)
    x, weight = torch.randn(batch, CHANNELS).to(dtype), torch.randn(CHANNELS, CONV_WIDTH).to(dtype)

    def delta_rule_step():
        for pool in pools:
            ops.gated_delta_rule_decode(**inputs, state=pool, slots=slots, use_qk_l2norm=True)

    def conv_step():
        for window in windows:
            ops.causal_conv1d_decode(x, window, slots, weight, None, "silu")

    seconds = best_seconds(delta_rule_step, repeats)
    moved = 2 * sum(pool.nbytes for pool in pools)  # each state read once and written once
    return {"batch": batch, "layers": layers, "delta_rule_step_ms": seconds * 1e3,
            "state_bytes_per_s": moved / seconds,
            "conv_step_ms": best_seconds(conv_step, repeats) * 1e3}


def prefill(ops, tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    """One sequence's prefill through one layer's delta rule and conv, tokens per second."""
    inputs = delta_rule_inputs(tokens, dtype)
    pool = torch.zeros(1, VALUE_HEADS, HEAD_DIM, HEAD_DIM)
    window = torch.zeros(1, CHANNELS, CONV_WIDTH - 1, dtype=dtype)
    x, weight = torch.randn(tokens, CHANNELS).to(dtype), torch.randn(CHANNELS, CONV_WIDTH).to(dtype)
    delta_rule = best_seconds(lambda: ops.gated_delta_rule_prefill(
        **inputs, state=pool, slot=0, use_qk_l2norm=True), repeats)
    conv = best_seconds(lambda: ops.causal_conv1d_prefill(x, window, 0, weight, None, "silu"),
                        repeats)
    return {"tokens": tokens, "delta_rule_tokens_per_s": tokens / delta_rule,
            "conv_tokens_per_s": tokens / conv}


def main(argv=None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()  # other work on the machine slows every number here
    dtype = getattr(torch, args.dtype)
    cpu = cpu_kernels.kernel_ops().recurrent
    bandwidth = read_bandwidth(huge=False)
    decodes = []
    for batch in args.batch:
        row = decode(cpu, batch, args.layers, dtype, args.repeats)
        row["share_of_read_bandwidth"] = row["state_bytes_per_s"] / bandwidth
        decodes.append(row)
    prefills = []
    for tokens in args.tokens:
        ours = prefill(cpu, tokens, dtype, args.repeats)
        oracle = prefill(reference, tokens, dtype, 1)
        prefills.append({"tokens": tokens, "cpp": ours, "reference": oracle,
                         "delta_rule_speedup": ours["delta_rule_tokens_per_s"]
                         / oracle["delta_rule_tokens_per_s"]})
    print(json.dumps({
        "cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "load_average_at_start": load, "dtype": args.dtype,
        "shape": {"key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "head_dim": HEAD_DIM,
                  "conv_channels": CHANNELS, "conv_width": CONV_WIDTH},
        "read_bandwidth_bytes_per_s": bandwidth, "decode": decodes, "prefill": prefills},
        indent=2))


if __name__ == "__main__":
    main()
