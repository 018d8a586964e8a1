"""What one more verification row costs a step: a least-squares plane through recent decode
steps' times against their sequences and their proposed tokens.

A decode step's time is about `fixed + per_sequence * sequences + per_proposal * proposed`.
Both slopes are fitted, not one per row: a step's time grows faster than linearly with its
rows (up to a point the weights' read hides the rows' compute, past it every row is
compute), so a proposal costs what a row costs beside the batch now running, and the steps
that have proposals measure that where it is paid. On one stream over bandwidth-bound
weights a proposal is a small share of a step; beside a batch, or on a CPU whose rows are
compute-bound, it costs about what it yields. The Speculator keeps only the proposals whose
expected yield pays for them (engine.spec_decode.proposer). Measured, not assumed: the share
differs by CPU class, dtype, model and batch several-fold (docs/performance-history.md,
'adaptive_k: proposals cut to what their rows pay for').
"""

from collections import deque

# Decode steps the plane is fitted over: recent enough to describe the batch now running.
WINDOW = 64
# No fit before this many steps, nor a proposals' slope while they barely differ (it is
# then noise): until the first fit nothing is cut, and a later window without it keeps the
# slope before (a batch whose proposals were all cut runs steps without any).
MIN_STEPS = 8
MIN_VARIANCE = 0.25


class StepCost:
    def __init__(self) -> None:
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self.per_proposal: float | None = None
        self.per_sequence = 0.0
        # The plane passes through the window's means: (sequences, proposed, seconds).
        self.center = (0.0, 0.0, 0.0)

    def observe(self, num_sequences: int, num_proposed: int, seconds: float) -> None:
        self.steps.append((num_sequences, num_proposed, seconds))
        n = len(self.steps)
        if n < MIN_STEPS:
            return
        means = tuple(sum(step[i] for step in self.steps) / n for i in range(3))
        deviations = [tuple(step[i] - means[i] for i in range(3)) for step in self.steps]
        ss = sum(d[0] * d[0] for d in deviations) / n
        pp = sum(d[1] * d[1] for d in deviations) / n
        sp = sum(d[0] * d[1] for d in deviations) / n
        st = sum(d[0] * d[2] for d in deviations) / n
        pt = sum(d[1] * d[2] for d in deviations) / n
        per_sequence, per_proposal = self.per_sequence, self.per_proposal
        determinant = ss * pp - sp * sp
        if pp < MIN_VARIANCE:
            # Proposals too few to fit (all cut, say): their slope stays the last fit's, and
            # the step's time follows the batch now running.
            if ss >= MIN_VARIANCE:
                per_sequence = st / ss
        elif ss < MIN_VARIANCE or determinant < MIN_VARIANCE * pp:
            # One batch size throughout (or sizes moving with the proposals): the proposals'
            # slope alone, the batch's part of the time in the mean.
            per_sequence, per_proposal = 0.0, pt / pp
        else:
            per_sequence = (st * pp - pt * sp) / determinant
            per_proposal = (pt * ss - st * sp) / determinant
        # Noise can tilt the plane below zero; nothing added to a step makes it faster.
        self.per_sequence = max(per_sequence, 0.0)
        self.per_proposal = None if per_proposal is None else max(per_proposal, 0.0)
        self.center = means

    def seconds(self, num_sequences: float, num_proposed: float) -> float:
        """The fitted time of a decode step."""
        sequences, proposed, seconds = self.center
        return max(seconds + self.per_sequence * (num_sequences - sequences)
                   + (self.per_proposal or 0.0) * (num_proposed - proposed), 1e-9)

    def worth(self, expected_tokens: float, tokens: float, num_sequences: int,
              num_proposed: int) -> bool:
        """Whether one more proposed token, yielding `expected_tokens`, raises the tokens per
        second of a step of `num_sequences` with `num_proposed` proposals yielding `tokens`:
        (tokens + e) / (time + per_proposal) > tokens / time exactly when
        e * time > tokens * per_proposal."""
        if self.per_proposal is None:
            return True
        return (expected_tokens * self.seconds(num_sequences, num_proposed)
                > tokens * self.per_proposal)
