"""The live panels' data: step history drained from the engine, token usage, arrivals."""

import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from engine.telemetry import EngineSnapshot, StepRecord

HISTORY_STEPS = 3000
HISTORY_SAMPLES = 600
# Tabs ticking within this long of each other share one snapshot: each snapshot is taken
# on the engine thread, between steps, so it is time the engine does not decode.
SNAPSHOT_MAX_AGE_S = 0.5


@dataclass(frozen=True, slots=True)
class LiveState:
    snapshot: EngineSnapshot
    records: tuple[StepRecord, ...]
    token_usage: tuple[tuple[float, float], ...]
    arrivals: dict[str, float]

    @property
    def now(self) -> float:
        return self.snapshot.time

    @property
    def busy(self) -> bool:
        return bool(self.snapshot.num_running or self.snapshot.num_waiting)


class LiveFeed:
    """Shared by every browser tab: whichever tab ticks first drains the engine's step
    queue into one history, so tabs do not steal records from each other."""

    def __init__(self, engine):
        self.engine = engine
        self._steps = engine.subscribe_steps(maxsize=HISTORY_STEPS)
        self._requests = engine.subscribe_requests()
        self._records: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)
        self._token_usage: deque[tuple[float, float]] = deque(maxlen=HISTORY_SAMPLES)
        self._arrivals: dict[str, float] = {}
        self._lock = threading.Lock()
        self._state: LiveState | None = None
        self._decode = lru_cache(maxsize=65536)(self._decode_uncached)

    def refresh(self) -> LiveState:
        with self._lock:
            if self._state is not None and time.time() - self._state.now < SNAPSHOT_MAX_AGE_S:
                return self._state
            snapshot = self.engine.snapshot()
            self._records.extend(self._steps.drain())
            # Arrival times give the timelines their waiting bars and the stats their TTFT:
            # from finished requests, and from running ones seen in the snapshot.
            for record in self._requests.drain():
                metrics = record.output.metrics
                if metrics is not None:
                    self._arrivals[record.output.request_id] = metrics.arrival_time
            for seq in snapshot.sequences:
                self._arrivals.setdefault(seq.request_id, seq.arrival_time)
            pool_tokens = snapshot.num_blocks * snapshot.block_size
            self._token_usage.append((snapshot.time, snapshot.num_used_tokens / pool_tokens))
            oldest = self._records[0].start_time if self._records else snapshot.time
            self._arrivals = {r: t for r, t in self._arrivals.items() if t >= oldest - 60}
            self._state = LiveState(snapshot, tuple(self._records), tuple(self._token_usage),
                                    dict(self._arrivals))
            return self._state

    def clear(self) -> None:
        """After a reconfigure the old history describes a pool that no longer exists."""
        with self._lock:
            self._records.clear()
            self._token_usage.clear()
            self._state = None

    def decode(self, token_ids: tuple[int, ...]) -> str:
        return self._decode(token_ids)

    def _decode_uncached(self, token_ids: tuple[int, ...]) -> str:
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=False)
