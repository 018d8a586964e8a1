"""Immutable records of what the engine did, for readers that must not touch its state."""

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens [start, end) of one sequence computed in a step; kind is prefill or decode."""

    request_id: str
    seq_id: str
    kind: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One EngineCore.step(): what ran, what was preempted, and the pool afterwards."""

    step: int
    start_time: float
    end_time: float
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    swapped_out: tuple[str, ...]
    swapped_in: tuple[str, ...]
    finished: tuple[str, ...]
    num_scheduled_tokens: int
    token_budget: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_generated_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time
