"""Which sequences propose, how many tokens, and how their proposals fared."""

from dataclasses import dataclass

from kvscope.engine.core.request import ChunkKind, Sequence
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.spec_decode.ngram_proposer import NgramProposer
from kvscope.engine.spec_decode.step_cost import StepCost
from kvscope.engine.speculative_config import SpeculativeConfig

# A sequence's acceptance is judged over its recent proposals: each verification's counts
# weigh this much less at every later one (about the last five verifications count).
ACCEPTANCE_DECAY = 0.8
# Judged only after this many (decayed) proposed tokens: one early miss says little.
MIN_JUDGED_DRAFT_TOKENS = 6.0
# A sequence judged unprofitable sits out this many steps, twice as many at each repeat.
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
# Before a sequence's own proposals are judged, its i-th proposed token is expected to be
# accepted with probability PRIOR_ACCEPTANCE ** i, an estimate worth this many judged tokens.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
# A draft model's proposals are drawn after scheduling, once the budget and the blocks are
# known (engine.spec_decode.draft_model); before, each is this placeholder.
PENDING_TOKEN = -1


@dataclass(slots=True)
class SpecAcceptance:
    """One sequence's recent proposals (decayed counts) and its pause."""

    drafted: float = 0.0
    accepted: float = 0.0
    # Tokens verification judged: the accepted ones and the first rejected (those after it
    # were never compared). accepted / judged is the chance of each next proposed token
    # being accepted, given those before it were.
    judged: float = 0.0
    paused_steps: int = 0  # steps left without proposals
    next_pause: int = FIRST_PAUSE_STEPS

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 1.0

    @property
    def acceptance(self) -> float:
        return ((self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT)
                / (self.judged + PRIOR_WEIGHT))

    def observe(self, num_drafted: int, num_accepted: int, min_rate: float) -> None:
        self.fade()
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.judged += num_accepted + (num_accepted < num_drafted)
        if self.drafted >= MIN_JUDGED_DRAFT_TOKENS and self.rate < min_rate:
            self.paused_steps = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
            # After the pause the sequence is judged afresh, on its next proposals.
            self.drafted = self.accepted = self.judged = 0.0
        elif self.rate >= min_rate:
            self.next_pause = FIRST_PAUSE_STEPS

    def fade(self) -> None:
        """Older verifications weigh less; a sequence whose proposals were all cut fades
        too, back toward the prior, so that it proposes again some time after."""
        self.drafted *= ACCEPTANCE_DECAY
        self.accepted *= ACCEPTANCE_DECAY
        self.judged *= ACCEPTANCE_DECAY


class Speculator:
    """Sets each running sequence's `spec_token_ids` before a step is scheduled (a draft
    model's as placeholders, to be drawn once scheduled).

    A sequence proposes while it decodes (its prompt done and its first token sampled, so
    parallel samples have forked), unless it is a beam (beam search ranks every candidate
    itself), has no room left under max_tokens or max_model_len, or sits out a pause after
    proposals that were mostly rejected. Nobody proposes while more sequences run than
    disable_by_batch_size: the forward is then compute-bound, and verification would cost
    what it saves.

    With adaptive_k, the proposals are then cut to the tokens worth their rows: each
    proposed token adds a row to the step (its cost from `step_cost`, fitted on the steps
    run) and yields a token with the chance that it and every proposal before it are
    accepted. Tokens are taken likeliest first while each raises the step's expected
    tokens per second.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.step_cost = StepCost()

    def propose(self, running: list[Sequence]) -> None:
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for seq in running:
            seq.spec_token_ids = self._proposal(seq) if enabled else []
        if enabled and self.config.adaptive_k:
            self._keep_what_pays(running)

    def _keep_what_pays(self, running: list[Sequence]) -> None:
        """Truncate proposals to the tokens whose expected yield pays for their rows. The
        i-th token of a sequence accepting each with chance a yields a ** i, falling with
        i, so taking the highest first keeps a prefix of every proposal."""
        candidates = sorted(
            ((seq.spec_stats.acceptance ** i, i, index)
             for index, seq in enumerate(running) for i in range(1, len(seq.spec_token_ids) + 1)),
            key=lambda candidate: (-candidate[0], candidate[1]))
        tokens = float(len(running))  # without proposals: a token each
        kept = [0] * len(running)
        for num_kept, (expected, _, index) in enumerate(candidates):
            if not self.step_cost.worth(expected, tokens, len(running), num_kept):
                break
            kept[index] += 1
            tokens += expected
        for seq, count in zip(running, kept):
            if seq.spec_token_ids and not count:
                seq.spec_stats.fade()
            del seq.spec_token_ids[count:]

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A step's time against its sequences and proposals, where every sequence decoded
        (a prefill chunk's rows cost another way); only adaptive_k reads the fit."""
        if (self.config.adaptive_k and plan.scheduled
                and all(item.kind is ChunkKind.DECODE for item in plan.scheduled)):
            self.step_cost.observe(len(plan.scheduled),
                                   sum(len(item.spec_token_ids) for item in plan.scheduled),
                                   seconds)

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
