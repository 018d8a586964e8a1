"""Sliding windows on a Gemma-3-1B-shaped model (random weights, bf16): what they save.

Prints JSON:
- `memory`: concurrent max-length sequences in the same KV cache bytes, Gemma 3's KV cache
  groups (one full, six sliding; engine.core.kv_groups) against full attention: the
  engine's memory plan (MemoryPlan.max_concurrency), and the sequences the real
  KVCacheManager admits at once when each is prefilled in chunks and then decodes (its
  sliding groups freeing what leaves their window between chunks); and the plan for the
  same shape with every layer windowed (a Mistral-like model).
- `decode`: one decode step (the whole model's forward over `--batch` sequences at
  `--context` tokens of KV, through the C++ decoder stack, or the eager layers with
  `--enforce-eager`) with Gemma 3's windows against the same weights with every layer
  global; and the step's share of the weight-bandwidth limit (weights + KV read per step
  over the time the machine takes to read them).

The model is built in-process (no checkpoint) and bound to the kernels the engine would
choose; its KV cache holds random values (the work does not depend on them).

Usage (run under `flock /work/bench.lock` on a shared machine):
  python bench/sliding_window.py --context 8192 --batch 1 --steps 3
"""

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from transformers import Gemma3TextConfig

from kvscope import kernels
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_groups import KVCacheGroup, kv_cache_groups, layers_per_block
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import MemoryPlan, plan_blocks
from kvscope.engine.worker.memory_bandwidth import weights_read_bandwidth
from kvscope.engine.worker.model_runner import default_dtype
from kvscope.engine.worker.models.attention import AttentionMetadata, layer_windows
from kvscope.engine.worker.models.bound_ops import bind_kernel_ops
from kvscope.engine.worker.models.gemma import GemmaForCausalLM

GiB = 1 << 30


def gemma3_1b_config(max_positions: int = 32768) -> Gemma3TextConfig:
    """google/gemma-3-1b-pt's shape: 26 layers, every sixth global, window 512 (also
    bench/models.py's gemma-3-1b)."""
    return Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def concurrency(config: Gemma3TextConfig, context: int, block_size: int, pool_gib: float,
                chunk: int) -> dict:
    """Max-length sequences `pool_gib` of KV cache holds: planned, and admitted."""
    layer_bytes = 2 * block_size * config.num_key_value_heads * config.head_dim * 2  # bf16

    def plan(groups: list[KVCacheGroup]) -> MemoryPlan:
        return plan_blocks(int(pool_gib * GiB), 1.0, 0, 0, layers_per_block(groups) * layer_bytes,
                           block_size, context, groups=tuple(groups))

    layers = range(config.num_hidden_layers)
    full = plan([KVCacheGroup(None, tuple(layers))])
    hybrid = plan(kv_cache_groups(layer_windows(config)))
    windowed = plan([KVCacheGroup(config.sliding_window, tuple(layers))])
    admitted_full, admitted_hybrid = admitted(full, chunk), admitted(hybrid, chunk)
    return {"pool_gib": pool_gib, "block_size": block_size, "max_model_len": context,
            "prefill_chunk": chunk, "kv_cache_groups": len(hybrid.groups),
            "layers_per_block": layers_per_block(hybrid.groups),
            "planned_full_attention_seqs": full.max_concurrency,
            "planned_gemma3_hybrid_seqs": hybrid.max_concurrency,
            "planned_gemma3_hybrid_vs_full": hybrid.max_concurrency / full.max_concurrency,
            "admitted_full_attention_seqs": admitted_full,
            "admitted_gemma3_hybrid_seqs": admitted_hybrid,
            "admitted_gemma3_hybrid_vs_full": admitted_hybrid / admitted_full,
            "planned_all_layers_windowed_seqs": windowed.max_concurrency,
            "planned_all_layers_windowed_vs_full": windowed.max_concurrency / full.max_concurrency}


def admitted(plan: MemoryPlan, chunk: int) -> int:
    """Sequences of max_model_len - 1 prompt tokens plus one decode the KV manager holds at
    once: each is prefilled `chunk` tokens a step (as chunked prefill does), then decodes
    its last token, until the pool refuses one's next chunk."""
    manager = KVCacheManager(plan.num_blocks, plan.block_size, enable_caching=False,
                             group_windows=plan.group_windows)
    count = 0
    while True:
        request = Request(str(count), None, [0] * (plan.max_model_len - 1), SamplingParams())
        seq = Sequence(request.request_id, request, 0, list(request.prompt_token_ids),
                       len(request.prompt_token_ids))
        while seq.num_computed_tokens < seq.num_tokens:
            step = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if manager.allocate_slots(seq, step) is None:
                return count
            seq.num_computed_tokens += step
        seq.token_ids.append(0)
        if manager.allocate_slots(seq, 1) is None:
            return count
        seq.num_computed_tokens += 1
        count += 1


def decode_inputs(batch: int, context: int, block_size: int):
    """A decode of `batch` sequences at position context - 1, each over its own blocks."""
    blocks_per_seq = -(-context // block_size)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, -1)
    position = context - 1
    slots = tables[:, position // block_size].long() * block_size + position % block_size
    # One KV cache group: every layer reads these tables (the step's work is the same).
    meta = AttentionMetadata(
        slot_mapping=slots[None], block_tables=tables[None],
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32))
    return (torch.randint(0, 1000, (batch,)), torch.full((batch,), position),
            meta, batch * blocks_per_seq)


def set_windows(model: GemmaForCausalLM, windows: list[int | None], stack: bool) -> None:
    """Each layer's sliding window (None: global), in its kind and its attention, and the
    decoder stack built anew over them (it takes the windows as it is built)."""
    for layer, window in zip(model.model.layers, windows, strict=True):
        layer.kind = dataclasses.replace(layer.kind, sliding_window=window)
        layer.self_attn.attn.sliding_window = window
    if stack:
        model.fuse_decoder_stack(torch.bfloat16)


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
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="tokens of a prompt prefilled per step when counting admissions")
    parser.add_argument("--memory-only", action="store_true",
                        help="count sequences only; skip the decode timing")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="time the eager layers instead of the C++ decoder stack")
    args = parser.parse_args(argv)

    config = gemma3_1b_config(args.context + 1)
    result = {"model": "Gemma-3-1B-shaped, random weights, bf16", "threads":
              torch.get_num_threads(),
              "memory": concurrency(config, args.context, args.block_size, args.pool_gib,
                                    args.prefill_chunk)}
    if args.memory_only:
        print(json.dumps(result, indent=2))
        return

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

    stack = not args.enforce_eager
    windows = [layer.sliding_window for layer in layers]
    set_windows(model, windows, stack)
    windowed = time_step(model, inputs, args.steps)
    set_windows(model, [None] * len(windows), stack)
    global_only = time_step(model, inputs, args.steps)

    weights = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    kv_row_bytes = 2 * layers[0].num_kv_heads * layers[0].head_dim * 2
    kv_bytes = args.batch * kv_row_bytes * sum(
        min(args.context, window or args.context) for window in windows)
    bandwidth = weights_read_bandwidth(weights)
    result["decode"] = {
        "backend": ops.backend, "forward": "eager layers" if args.enforce_eager
        else "one-call decoder stack", "context": args.context, "batch": args.batch,
        "windowed_step_s": windowed, "global_only_step_s": global_only,
        "global_only_vs_windowed": global_only / windowed,
        "weight_bytes": weight_bytes, "kv_bytes_read_windowed": kv_bytes,
        "weights_read_gb_s": bandwidth / 1e9,
        "bandwidth_share_windowed": (weight_bytes + kv_bytes) / windowed / bandwidth,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
