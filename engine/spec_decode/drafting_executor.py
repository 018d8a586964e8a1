"""DraftingExecutor: the target's ModelRunner with a draft model beside it, as one
StepExecutor, so the engine core runs the draft method as it runs any other."""

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.spec_decode.draft_model import DraftModelProposer
from kvscope.engine.worker.memory import MemoryPlan
from kvscope.engine.worker.model_runner import ModelInputs, ModelRunner


class DraftingExecutor:
    """Everything the target runner does, plus the draft: one memory plan for both (the
    draft's weights, activations and K/V per block come out of the same budget), a draft
    pool with a block for each target block, the same block moves in both pools, and
    before each forward the draft's own forwards, which fill in the step's proposals.
    Other attributes are the target runner's."""

    def __init__(self, target: ModelRunner, proposer: DraftModelProposer) -> None:
        self.target = target
        self.proposer = proposer

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def plan_memory(self, config: EngineConfig) -> MemoryPlan:
        return self.target.plan_memory(config, draft=self.proposer.runner)

    def allocate_kv_cache(self, block_size: int, num_blocks: int,
                          kv_cache_dtype: str = "auto") -> None:
        for runner in (self.target, self.proposer.runner):
            runner.allocate_kv_cache(block_size, num_blocks, kv_cache_dtype)

    def allocate_swap_space(self, num_blocks: int) -> None:
        for runner in (self.target, self.proposer.runner):
            runner.allocate_swap_space(num_blocks)

    def move_blocks(self, plan: SchedulerOutput) -> None:
        for runner in (self.target, self.proposer.runner):
            runner.move_blocks(plan)

    def prepare(self, scheduled: list[ScheduledSequence], all_positions: tuple[int, ...] = ()
                ) -> ModelInputs:
        """The draft's forwards fill in the step's proposals, which the target's inputs hold."""
        self.proposer.run(scheduled)
        return self.target.prepare(scheduled, all_positions)


def with_draft_model(runner, config: EngineConfig):
    """The executor for a resolved config: the target runner itself, or for
    method='draft_model' the target with its draft loaded (a reconfigured engine is handed
    its old executor: the target is kept, the draft loaded afresh for the new config)."""
    target = runner.target if isinstance(runner, DraftingExecutor) else runner
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return target
    return DraftingExecutor(target, DraftModelProposer.load(config, target))
