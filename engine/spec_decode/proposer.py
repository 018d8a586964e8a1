"""Which sequences propose, how many tokens, and how their proposals fared."""

from dataclasses import dataclass

from kvscope.engine.core.request import Sequence
from kvscope.engine.spec_decode.config import SpeculativeConfig
from kvscope.engine.spec_decode.ngram_proposer import NgramProposer

# A sequence's acceptance is judged over its recent proposals: each verification's counts
# weigh this much less at every later one (about the last five verifications count).
ACCEPTANCE_DECAY = 0.8
# Judged only after this many (decayed) proposed tokens: one early miss says little.
MIN_JUDGED_DRAFT_TOKENS = 6.0
# A sequence judged unprofitable sits out this many steps, twice as many at each repeat.
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
# A draft model's proposals are drawn after scheduling, once the budget and the blocks are
# known (engine.spec_decode.draft_model); before, each is this placeholder.
PENDING_TOKEN = -1


@dataclass(slots=True)
class SpecAcceptance:
    """One sequence's recent proposals (decayed counts) and its pause."""

    drafted: float = 0.0
    accepted: float = 0.0
    paused_steps: int = 0  # steps left without proposals
    next_pause: int = FIRST_PAUSE_STEPS

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 1.0

    def observe(self, num_drafted: int, num_accepted: int, min_rate: float) -> None:
        self.drafted = self.drafted * ACCEPTANCE_DECAY + num_drafted
        self.accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        if self.drafted >= MIN_JUDGED_DRAFT_TOKENS and self.rate < min_rate:
            self.paused_steps = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
            # After the pause the sequence is judged afresh, on its next proposals.
            self.drafted = self.accepted = 0.0
        elif self.rate >= min_rate:
            self.next_pause = FIRST_PAUSE_STEPS


class Speculator:
    """Sets each running sequence's `spec_token_ids` before a step is scheduled (a draft
    model's as placeholders, to be drawn once scheduled).

    A sequence proposes while it decodes (its prompt done and its first token sampled, so
    parallel samples have forked), unless it is a beam (beam search ranks every candidate
    itself), has no room left under max_tokens or max_model_len, or sits out a pause after
    proposals that were mostly rejected. Nobody proposes while more sequences run than
    disable_by_batch_size: the forward is then compute-bound, and verification would cost
    what it saves.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)

    def propose(self, running: list[Sequence]) -> None:
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for seq in running:
            seq.spec_token_ids = self._proposal(seq) if enabled else []

    def _proposal(self, seq: Sequence) -> list[int]:
        if (seq.request.beam is not None or seq.num_output_tokens == 0
                or seq.num_computed_tokens != seq.num_tokens - 1):
            return []
        stats = seq.spec_stats
        if stats is None:
            stats = seq.spec_stats = SpecAcceptance()
        if stats.paused_steps:
            stats.paused_steps -= 1
            return []
        max_tokens = seq.request.params.max_tokens
        # Positions up to num_tokens - 1 + k must exist, and the step's own token after the
        # proposals must still be wanted.
        room = self.max_model_len - seq.num_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        k = min(self.config.num_speculative_tokens, room)
        if k <= 0:
            return []
        if self.proposer is None:
            return [PENDING_TOKEN] * k
        return self.proposer.propose(seq.token_ids, k)

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """What verification kept of the sequence's proposals."""
        seq.spec_stats.observe(num_drafted, num_accepted, self.config.min_acceptance_rate)
