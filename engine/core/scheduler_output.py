"""What one scheduling step decided: data only, read by the model runner and the core."""

from dataclasses import dataclass, field

import torch

from kvscope.engine.core.kv_events import PrefixMiss, SequencePreempted
from kvscope.engine.core.request import ChunkKind, Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start, start + num_tokens). With
    speculative decoding its last len(spec_token_ids) positions hold proposed tokens, not
    yet the sequence's: the step verifies them."""

    seq: Sequence
    start: int
    num_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    # The distribution each proposal was drawn from, [len(spec_token_ids), vocab], where a
    # draft model sampled them (rejection sampling needs it); None: deterministic proposals.
    spec_probs: torch.Tensor | None = None
    kind: ChunkKind = field(init=False)

    def __post_init__(self) -> None:
        self.kind = (ChunkKind.DECODE if self.num_real_tokens == 1
                     and self.start >= self.seq.num_prompt_tokens else ChunkKind.PREFILL)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_real_tokens(self) -> int:
        """The chunk's tokens that are the sequence's own (not proposals)."""
        return self.num_tokens - len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so its logits pick the next one (and,
        with proposals, verify each of them)."""
        return self.start + self.num_real_tokens == self.seq.num_tokens

    def input_token_ids(self) -> list[int]:
        """The tokens at positions [start, end): the sequence's, then the proposals."""
        return (self.seq.token_ids[self.start:self.start + self.num_real_tokens]
                + self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Block moves the device must do before the forward, in this order:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    # (source, target) state slot copies (a fork's, engine.core.state_slots): set at launch,
    # as a fork made while the plan waited to launch owes them before its forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    preemptions: list[SequencePreempted] = field(default_factory=list)  # why, one each
    # Admissions whose prefix hit stopped short of tokens the cache had seen, and why.
    prefix_misses: list[PrefixMiss] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # What scheduling this plan added to the KV manager's counters (stat_totals order:
    # prefix-cache queries and hits, blocks swapped out and in).
    stat_deltas: tuple[int, ...] = (0, 0, 0, 0)
