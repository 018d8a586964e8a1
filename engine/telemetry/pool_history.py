"""PoolHistory: the pool as it was after each recorded delta, for stepping back and forth.

A reader's PoolMirror only moves forward. The history keeps the deltas a reader applied
(each one a "frame") and, every so many frames, a copy of the mirror as it was then (a
checkpoint): the pool at frame f is the last checkpoint at or before f with the deltas
after it applied again, through the mirror's own `apply`. Nothing here inverts a delta,
so stepping back shows exactly what the mirror showed then.

The live dashboard feeds one from its reader (ui.live.LiveFeed); a saved session builds
one from the pool records of its log (storage.reader.pool_history).
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import PoolDelta

MAX_FRAMES = 3000
# A checkpoint every this many frames (a scrub applies at most this many deltas again),
# more apart for large pools (each checkpoint copies the whole mirror), but at least
# CHECKPOINTS_PER_WINDOW in a full history, so old frames can be dropped a few at a time.
MIN_CHECKPOINT_FRAMES = 64
BLOCKS_PER_CHECKPOINT_FRAME = 64
CHECKPOINTS_PER_WINDOW = 4


@dataclass(frozen=True, slots=True)
class Frame:
    """One recorded delta: its number in this history, and the step the pool was at."""

    number: int
    step: int
    time: float
    epoch: int
    index: int  # the delta's index in its pool's epoch


class PoolHistory:
    """Owned by one reader (not thread-safe). Frame numbers count from 0 and keep counting
    as old frames are dropped, so a frame number stays valid while it is kept."""

    def __init__(self, max_frames: int = MAX_FRAMES) -> None:
        self.max_frames = max_frames
        self._deltas: deque[PoolDelta] = deque()  # frames [first, first + len)
        self._first = 0
        self._checkpoints: deque[tuple[int, PoolMirror]] = deque()  # (frame, the pool then)
        self._previous: PoolDelta | None = None

    def __len__(self) -> int:
        return len(self._deltas)

    @property
    def first(self) -> int | None:
        """The oldest frame that can be shown (None: nothing recorded yet)."""
        return self._checkpoints[0][0] if self._checkpoints else None

    @property
    def last(self) -> int | None:
        return self._first + len(self._deltas) - 1 if self._deltas else None

    def add(self, mirror: PoolMirror, delta: PoolDelta) -> None:
        """Record `delta`, which `mirror` (a ready one) has just applied."""
        number = self._first + len(self._deltas)
        previous = self._previous
        follows = previous is not None and (
            (delta.epoch == previous.epoch and delta.index == previous.index + 1)
            or delta.index == 0)  # a rebuilt pool's delta 0 starts it afresh
        self._deltas.append(delta)
        self._previous = delta
        spacing = min(max(MIN_CHECKPOINT_FRAMES, mirror.num_blocks // BLOCKS_PER_CHECKPOINT_FRAME),
                      max(self.max_frames // CHECKPOINTS_PER_WINDOW, 1))
        # After a gap (a resync) the deltas before cannot lead here: start a new chain.
        if not follows or number - self._checkpoints[-1][0] >= spacing:
            self._checkpoints.append((number, mirror.copy()))
        # Old frames go a checkpoint's worth at a time: the frames after a checkpoint are
        # rebuilt from it, so its deltas stay until the next checkpoint is the oldest.
        while len(self._deltas) > self.max_frames and len(self._checkpoints) > 1:
            self._checkpoints.popleft()
            while self._first < self._checkpoints[0][0]:
                self._deltas.popleft()
                self._first += 1

    def clamp(self, number: int | None) -> int | None:
        """The nearest frame that can be shown (None: the latest)."""
        if self.first is None:
            return None
        return self.last if number is None else min(max(int(number), self.first), self.last)

    def frame(self, number: int) -> Frame:
        delta = self._deltas[number - self._first]
        counters = delta.counters
        return Frame(number, counters.step, counters.time, delta.epoch, delta.index)

    def frames(self) -> Iterable[Frame]:
        """Every frame that can be shown, oldest first."""
        return (self.frame(number) for number in range(self.first, self.last + 1)) \
            if self.first is not None else ()

    def mirror_at(self, number: int) -> PoolMirror:
        """A new mirror of the pool as it was after frame `number` (clamped to the kept
        frames); ValueError when nothing is recorded yet."""
        number = self.clamp(number)
        if number is None:
            raise ValueError("no pool frames recorded yet")
        start, checkpoint = next((frame, mirror) for frame, mirror in reversed(self._checkpoints)
                                 if frame <= number)
        mirror = checkpoint.copy()
        for frame in range(start + 1, number + 1):
            mirror.apply(self._deltas[frame - self._first])
        return mirror


def history_of(records: Iterable) -> PoolHistory:
    """A history of every delta in a stream of pool records (a base, its slices, deltas;
    after a missed delta, a new base), as a reader would have applied them."""
    history = PoolHistory(max_frames=1 << 62)
    mirror = PoolMirror()
    for record in records:
        if not mirror.apply(record):
            mirror.awaiting_base = True  # the stream carries the new snapshot that follows
        elif isinstance(record, PoolDelta) and mirror.ready:
            history.add(mirror, record)
    return history
