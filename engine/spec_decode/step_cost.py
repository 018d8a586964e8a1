"""What one more row costs a step: a least-squares line through recent decode steps' times
against their rows (each sequence's token plus its proposals).

A step's time is about `fixed + per_row * rows`. `fixed` is what any step pays, reading
every weight once; `per_row` is each row's compute. On one stream over bandwidth-bound
weights per_row is a small share of a step, and a verification row is nearly free; in a
large batch, or on a CPU whose rows are compute-bound, each row costs about what it
yields. The Speculator keeps only proposals whose expected yield pays for their rows
(engine.spec_decode.proposer). Measured, not assumed: the share differs by CPU class,
dtype, model and batch several-fold (docs/performance.md).
"""

from collections import deque

# Decode steps the line is fitted over: recent enough to describe the batch now running.
WINDOW = 64
# No line before this many steps, nor while their rows barely differ (the slope is then
# noise): until then nothing is cut.
MIN_STEPS = 8
MIN_ROW_VARIANCE = 0.5


class StepCost:
    """The fitted line; `per_row` is None until the steps allow a fit, and a fit is kept
    while later windows do not (a batch whose proposals were all cut runs steps of equal
    rows)."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.fixed = 0.0
        self.per_row: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))
        n = len(self.steps)
        if n < MIN_STEPS:
            return
        mean_rows = sum(r for r, _ in self.steps) / n
        mean_seconds = sum(s for _, s in self.steps) / n
        variance = sum((r - mean_rows) ** 2 for r, _ in self.steps) / n
        if variance < MIN_ROW_VARIANCE:
            return
        covariance = sum((r - mean_rows) * (s - mean_seconds) for r, s in self.steps) / n
        # Noise can tilt the line below zero at either end; a row never saves time and a
        # step never costs less than nothing.
        self.per_row = max(covariance / variance, 0.0)
        self.fixed = max(mean_seconds - self.per_row * mean_rows, 0.0)

    def worth(self, expected_tokens: float, tokens: float, rows: float) -> bool:
        """Whether one more row yielding `expected_tokens` raises a step's tokens per second,
        the step so far yielding `tokens` over `rows` rows: (tokens + e) / (time + per_row)
        > tokens / time exactly when e * time > tokens * per_row."""
        if self.per_row is None:
            return True
        return expected_tokens * (self.fixed + self.per_row * rows) > tokens * self.per_row
