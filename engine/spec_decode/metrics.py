"""Speculative decoding's counts, as vLLM's SpecDecodingStats and its Prometheus names."""

from dataclasses import dataclass, field

# One verified proposal of a step: (seq_id, tokens proposed, tokens accepted). A plain
# tuple, as the step record's chunks are (engine.telemetry.records says why).
SpecDraft = tuple[str, int, int]
SPEC_DRAFT_FIELDS = ("seq_id", "num_draft_tokens", "num_accepted_tokens")


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals over proposals: drafts (verified proposals), their tokens, the tokens
    accepted, and how often the proposal's i-th token was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, drafts: tuple[SpecDraft, ...]) -> None:
        for _, num_draft_tokens, num_accepted in drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted
            per_pos = self.num_accepted_tokens_per_pos
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
            for position in range(num_accepted):  # accepted tokens are always a prefix
                per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying forward yields per sequence: the accepted ones plus its own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
