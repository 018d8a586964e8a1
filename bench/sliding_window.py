"""Sliding windows on a Gemma-3-1B-shaped model (random weights, bf16): what they save.

Prints JSON:
- `memory`: concurrent max-length sequences the engine's memory plan fits in the same
  pool, with the KV manager's window rule (MemoryPlan.max_concurrency) against full
  attention, for this Gemma 3 shape and for the same shape with every layer windowed (a
  Mistral-like model, where the manager frees out-of-window blocks).
- `decode`: one decode step (the whole model's forward over `--batch` sequences at
  `--context` tokens of KV) with Gemma 3's windows against the same weights with every
  layer global; and the step's share of the weight-bandwidth limit (weights + KV read per
  step over the time the machine takes to read them).

The model is built in-process (no checkpoint) and bound to the kernels the engine would
choose; its KV cache holds random values (the work does not depend on them).

Usage (run under `flock /work/bench.lock` on a shared machine):
  python bench/sliding_window.py --context 8192 --batch 1 --steps 3
"""

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from transformers import Gemma3TextConfig

from kvscope import kernels
from kvscope.engine.worker.memory import plan_blocks
from kvscope.engine.worker.memory_bandwidth import weights_read_bandwidth
from kvscope.engine.worker.model_runner import default_dtype
from kvscope.engine.worker.models.attention import AttentionMetadata
from kvscope.engine.worker.models.bound_ops import bind_kernel_ops
from kvscope.engine.worker.models.gemma import GemmaForCausalLM

GiB = 1 << 30


def gemma3_1b_config(context: int) -> Gemma3TextConfig:
    """google/gemma-3-1b-pt's shape: 26 layers, every sixth global, window 512."""
    return Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=context + 1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def concurrency(config: Gemma3TextConfig, context: int, block_size: int,
                pool_gib: float) -> dict:
    """Max-length sequences the memory plan fits in `pool_gib` of KV cache."""
    bytes_per_block = (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
                       * config.head_dim * 2)

    def plan(window):
        return plan_blocks(int(pool_gib * GiB), 1.0, 0, 0, bytes_per_block, block_size,
                           context, sliding_window=window).max_concurrency

    full, windowed = plan(None), plan(config.sliding_window)
    # A model mixing global and windowed layers keeps every block (ModelRunner.sliding_window
    # is None for it): Gemma 3 fits what full attention fits. One whose layers all share
    # the window frees what leaves it.
    return {"pool_gib": pool_gib, "block_size": block_size, "max_model_len": context,
            "full_attention_seqs": full, "gemma3_hybrid_seqs": full,
            "gemma3_hybrid_vs_full": 1.0, "all_layers_windowed_seqs": windowed,
            "all_layers_windowed_vs_full": windowed / full}


def decode_inputs(batch: int, context: int, block_size: int):
    """A decode of `batch` sequences at position context - 1, each over its own blocks."""
    blocks_per_seq = -(-context // block_size)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, -1)
    position = context - 1
    slots = tables[:, position // block_size].long() * block_size + position % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32))
    return (torch.randint(0, 1000, (batch,)), torch.full((batch,), position),
            meta, batch * blocks_per_seq)


def time_step(model, inputs, steps: int) -> float:
    input_ids, positions, meta, _ = inputs
    with torch.inference_mode():
        model.compute_logits(model(input_ids, positions, meta))  # warm-up
        best = float("inf")
        for _ in range(steps):
            started = time.perf_counter()
            model.compute_logits(model(input_ids, positions, meta))
            best = min(best, time.perf_counter() - started)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=4.0)
    args = parser.parse_args(argv)

    config = gemma3_1b_config(args.context)
    result = {"model": "Gemma-3-1B-shaped, random weights, bf16", "threads":
              torch.get_num_threads(),
              "memory": concurrency(config, args.context, args.block_size, args.pool_gib)}

    ops = kernels.select_ops("cpu")
    with default_dtype(torch.bfloat16):
        model = GemmaForCausalLM(config, args.context + 1, args.context).eval()
    bind_kernel_ops(model, ops)
    inputs = decode_inputs(args.batch, args.context, args.block_size)
    layers = model.attention_layers()
    for layer in layers:
        shape = (inputs[3], args.block_size, layer.num_kv_heads, layer.head_dim)
        layer.key_cache = torch.randn(shape, dtype=torch.bfloat16)
        layer.value_cache = torch.randn(shape, dtype=torch.bfloat16)

    windowed = time_step(model, inputs, args.steps)
    windows = [layer.sliding_window for layer in layers]
    for layer in layers:
        layer.sliding_window = None
    global_only = time_step(model, inputs, args.steps)
    for layer, window in zip(layers, windows, strict=True):
        layer.sliding_window = window

    weights = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    kv_row_bytes = 2 * layers[0].num_kv_heads * layers[0].head_dim * 2
    kv_bytes = args.batch * kv_row_bytes * sum(
        min(args.context, window or args.context) for window in windows)
    bandwidth = weights_read_bandwidth(weights)
    result["decode"] = {
        "backend": ops.backend, "context": args.context, "batch": args.batch,
        "windowed_step_s": windowed, "global_only_step_s": global_only,
        "global_only_vs_windowed": global_only / windowed,
        "weight_bytes": weight_bytes, "kv_bytes_read_windowed": kv_bytes,
        "weights_read_gb_s": bandwidth / 1e9,
        "bandwidth_share_windowed": (weight_bytes + kv_bytes) / windowed / bandwidth,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
