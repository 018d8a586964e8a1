"""State slots on a Qwen3.5-2B-shaped model: concurrent long sequences in the same memory.

Prints JSON: how many `--context`-token sequences run at once in `--pool-gib` of KV cache
and state memory (bf16 K/V, the delta rule's fp32 state), by the engine's own memory
plan (engine.worker.memory.plan_blocks): the hybrid model (paged blocks for its
full-attention layers, one state slot per sequence for its Gated DeltaNet layers) against
the same shape with every layer full attention. A sequence needs its slot and its blocks,
so the hybrid's count is min(slots, blocks / blocks per sequence), taken at the
max_num_seqs that makes it largest (the plan gives the slots max_num_seqs of the budget
first). The layers' state shapes come from the model code itself, built on the meta
device (no weights).

The shape is the one named in `shape` of the output: Qwen3.5's layer pattern (three Gated
DeltaNet layers, then one full-attention layer) at a 2B-like size chosen here, not read
from a published checkpoint (head_dim 256 with 2 KV heads, 16 key and 16 value heads of
128 in the delta rule, conv width 4); --layers, --hidden change it.

Usage: python bench/state_slots.py --context 8192 --pool-gib 16
"""

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402

from kvscope.engine.core.kv_groups import KVCacheGroup
from kvscope.engine.worker.memory import GiB, kv_bytes_per_block, plan_blocks
from kvscope.engine.worker.model_runner import default_dtype
from kvscope.engine.worker.models.qwen3_5 import GatedDeltaNet


def qwen3_5_config(layers: int, hidden: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, intermediate_size=6144, vocab_size=248320)


def concurrency(config: Qwen3_5TextConfig, context: int, block_size: int,
                pool_bytes: int) -> dict:
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    linear = len(config.layer_types) - len(full)
    with default_dtype(torch.bfloat16), torch.device("meta"):
        slot_bytes = linear * GatedDeltaNet(config).slot_bytes()
    blocks_per_seq = -(-context // block_size)

    hybrid_block = kv_bytes_per_block(len(full), block_size, config.num_key_value_heads,
                                      config.head_dim, torch.bfloat16)

    def hybrid(max_num_seqs: int):
        return plan_blocks(pool_bytes, 1.0, 0, 0, hybrid_block, block_size, context,
                           groups=(KVCacheGroup(None, tuple(full)),),
                           bytes_per_state_slot=slot_bytes, max_num_seqs=max_num_seqs,
                           num_state_layers=linear)

    # Every layer full attention: the plan's own figure for its recurrent layers as
    # attention layers (what the dashboard's memory panel compares against).
    full_block = hybrid(1).full_attention_bytes_per_block
    full_sequences = plan_blocks(pool_bytes, 1.0, 0, 0, full_block, block_size,
                                 context).num_blocks // blocks_per_seq
    best = (0, 0)
    for max_num_seqs in range(1, 4 * full_sequences + 64):
        plan = hybrid(max_num_seqs)
        best = max(best, (min(plan.num_state_slots, plan.num_blocks // blocks_per_seq),
                          max_num_seqs))
    sequences, max_num_seqs = best
    return {"context": context, "pool_gib": pool_bytes / GiB,
            "full_attention_layers": len(full), "gated_deltanet_layers": linear,
            "hybrid": {"bytes_per_state_slot": slot_bytes,
                       "kv_bytes_per_sequence": blocks_per_seq * hybrid_block,
                       "max_num_seqs": max_num_seqs, "concurrent_sequences": sequences},
            "all_full_attention": {"concurrent_sequences": full_sequences},
            "ratio": sequences / max(full_sequences, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    config = qwen3_5_config(args.layers, args.hidden)
    result = concurrency(config, args.context, args.block_size, int(args.pool_gib * GiB))
    result["shape"] = {key: getattr(config, key) for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
