"""SimulatedRunner: an executor that stands in for ModelRunner under the real EngineCore.

It knows the model's config and tokenizer but loads no weights and allocates no KV
tensors: the block pool hands out real block ids with nothing behind them, and a step's
"forward" returns a placeholder token for every sequence that samples. The replay forces
every output's length (ignore_eos, max_tokens), so the scheduler, the KV-cache manager and
the pool make exactly the decisions they make live; only time is modelled (cost_model.py,
applied by the replay loop).
"""

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_groups import kv_cache_groups, layers_per_block
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.worker.loader import (
    load_config,
    load_generation_config,
    load_tokenizer,
    resolve_model_path,
)
from kvscope.engine.worker.memory import MemoryPlan, kv_bytes_per_block, plan_blocks
from kvscope.engine.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from kvscope.engine.worker.models.kv_layers import cache_layers


class SimulatedRunner:
    """The StepExecutor of a simulated replay.

    The pool is sized by `num_gpu_blocks_override` (a GPU-scale pool costs nothing here);
    without it, by the memory plan a real ModelRunner of the same model makes (`sizing`),
    so simulated and live pools have the same blocks.
    """

    def __init__(self, config: EngineConfig, sizing: ModelRunner | None = None) -> None:
        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.generation_config = load_generation_config(self.model_path, self.hf_config)
        self.max_positions = self.hf_config.max_position_embeddings
        # The live engine's KV cache groups: blocks leave sliding windows as they do live.
        self.cache_layers = cache_layers(self.hf_config)
        self.kv_groups = kv_cache_groups([layer.window for layer in self.cache_layers])
        self.group_windows = tuple(group.window for group in self.kv_groups)
        # No forward, so no routing to count (a simulated step's record has no experts).
        self.expert_layout = None
        self.expert_tokens = torch.zeros(0, 0, dtype=torch.int64)
        self.device = resolve_device("cpu")
        self.dtype = resolve_dtype(config.dtype, resolve_device(config.device),
                                   config.quantization)
        self.sizing = sizing
        special = set(self.tokenizer.all_special_ids)
        # Any ordinary token: stop conditions are off in a replay, its value never matters.
        self.placeholder_token = next(t for t in range(len(self.tokenizer)) if t not in special)

    def bytes_per_block(self, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """K and V for block_size tokens in a KV cache group's layers, scales included, as
        ModelRunner.bytes_per_block: every layer slot as wide as the widest layer's."""
        return max(kv_bytes_per_block(layers_per_block(self.kv_groups), block_size,
                                      layer.num_kv_heads, layer.head_dim, self.dtype,
                                      kv_cache_dtype) for layer in self.cache_layers)

    def plan_memory(self, config: EngineConfig) -> MemoryPlan:
        if config.num_gpu_blocks_override is None:
            if self.sizing is None:
                raise ValueError("num_gpu_blocks_override: a simulated replay needs it, or a "
                                 "model runner to size the pool as the live engine would")
            return self.sizing.plan_memory(config)
        return plan_blocks(0, config.gpu_memory_utilization, 0, 0,
                           self.bytes_per_block(config.block_size, config.kv_cache_dtype),
                           config.block_size, config.max_model_len, config.num_gpu_blocks_override,
                           tuple(self.kv_groups), kv_cache_dtype=config.kv_cache_dtype,
                           auto_bytes_per_block=self.bytes_per_block(config.block_size))

    def allocate_kv_cache(self, block_size: int, num_blocks: int,
                          kv_cache_dtype: str = "auto") -> None:
        """Nothing to allocate: block ids are all the simulator needs."""
        self.block_size = block_size

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Swap blocks are ids in the cache manager's CPU pool; no memory behind them."""

    def wait_until_resident(self) -> None:
        """No pool in memory to wait for."""

    def move_blocks(self, plan: SchedulerOutput) -> None:
        """Swaps and copy-on-write copies move no data here."""

    def prepare(self, scheduled: list[ScheduledSequence],
                all_positions: tuple[int, ...] = ()) -> int:
        """All a simulated forward needs: how many sequences sample."""
        return sum(item.samples for item in scheduled)

    def execute(self, num_sampling: int) -> tuple[list[int], dict]:
        """The placeholder token for each sampling sequence, in schedule order."""
        return [self.placeholder_token] * num_sampling, {}
