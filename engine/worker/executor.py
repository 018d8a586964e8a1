"""StepExecutor: what EngineCore needs from whatever runs a step's forward.

ModelRunner (model_runner.py) is the executor that serves: weights, KV tensors, a forward
that returns logits. The replay simulator's SimulatedRunner (engine/replay) is the other:
the same scheduler, KV-cache manager and block pool drive it, but it has no weights and no
KV tensors, and instead of logits it returns the token of each sampling row itself.
With a draft model (speculative decoding), engine.spec_decode.drafting_executor's
DraftingExecutor wraps the ModelRunner: the draft's pool and forwards ride along.
"""

from typing import Protocol

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.worker.memory import MemoryPlan
from kvscope.engine.worker.models.moe import ExpertLayout

# One row per scheduled sequence that samples, in schedule order: logits [rows, vocab] to
# sample from, or the token ids an executor without a forward picked itself.
StepLogits = torch.Tensor | list[int]


class StepExecutor(Protocol):
    tokenizer: object
    hf_config: object
    generation_config: object
    device: torch.device
    max_positions: int
    group_windows: tuple[int | None, ...]  # each KV cache group's window (engine.core.kv_groups)
    # A mixture-of-experts model's experts (models.moe.ExpertLayout; None for a dense model
    # or an executor without a forward) and each MoE layer's tokens per expert in the latest
    # forward, int64 [MoE layers, experts], which the next forward overwrites.
    expert_layout: ExpertLayout | None
    expert_tokens: torch.Tensor

    def plan_memory(self, config: EngineConfig) -> MemoryPlan: ...

    def allocate_kv_cache(self, block_size: int, num_blocks: int,
                          kv_cache_dtype: str = "auto") -> None: ...

    def allocate_swap_space(self, num_blocks: int) -> None: ...

    # Returns once the KV pool is in memory (a pool may be populated in the background);
    # the engine calls it before each step.
    def wait_until_resident(self) -> None: ...

    def move_blocks(self, plan: SchedulerOutput) -> None: ...

    # A step's forward in two halves. `prepare` copies out of the engine's sequences all
    # that the forward reads (token ids, positions, block tables), on the engine's thread;
    # `execute` runs the forward on that copy alone, so with async scheduling it can run on
    # another thread while the engine schedules the next step (EngineCore.step).
    def prepare(self, scheduled: list[ScheduledSequence], all_positions: tuple[int, ...] = ()
                ) -> object: ...

    def execute(self, prepared: object) -> tuple[StepLogits, dict[int, torch.Tensor]]: ...
