"""The live panels' data: the pool mirror, step history from the engine, token usage,
arrivals. After the start nothing here asks the engine thread for a full snapshot: the
mirror follows the engine's per-step pool deltas."""

import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.entrypoints.view import EngineCounters, EngineView
from kvscope.engine.telemetry.pool_history import Frame, PoolHistory
from kvscope.engine.telemetry.pool_mirror import PoolMirror, PoolReader
from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui.events import Evictions

HISTORY_STEPS = 3000
HISTORY_SAMPLES = 600
# How long a refresh waits for the mirror's first snapshot (a few engine-loop turns).
FIRST_SNAPSHOT_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class LiveState:
    snapshot: PoolMirror  # the pool as of this refresh, read like an EngineSnapshot
    records: tuple[StepRecord, ...]
    # (time, blocks in use, token slots filled), both fractions of the pool read from one
    # snapshot: drawn from separate samplings, the token line lagged the block line and
    # showed more tokens than the blocks in use could hold whenever usage fell.
    usage_samples: tuple[tuple[float, float, float], ...]
    arrivals: dict[str, float]
    now: float
    replica: int  # the engine replica shown (0 for a single engine)
    # That replica's totals since the engine started (/metrics'); None for a past frame,
    # whose since-start totals were not kept.
    counters: EngineCounters | None
    evictions: tuple[Evictions, ...]  # cached blocks evicted, by the step that saw them
    blocks_step: int  # the step after which the pool's blocks last changed
    paused: Frame | None = None  # the recorded frame shown (None: the live pool)
    previous: PoolMirror | None = None  # a past frame's: the pool at the frame before it
    # The recurrent layers' state slots, read live from the engine (not recorded): None
    # for a past frame or a model without recurrent layers.
    slots: SlotTable | None = None

    @property
    def busy(self) -> bool:
        return bool(self.snapshot.num_running or self.snapshot.num_waiting)


class LiveFeed:
    """Shared by every browser tab: whichever tab ticks first drains the engine's step
    queue into one history and its pool deltas into one mirror, so tabs do not steal
    records from each other. The mirror changes at each refresh, from any tab or handler:
    hold `lock` while reading a live state's mirror (ui.panels.PanelRenderer renders
    under it)."""

    def __init__(self, engine: EngineView, replica: int = 0):
        self.engine = engine
        self._steps = engine.subscribe_steps(maxsize=HISTORY_STEPS)
        self._pool = PoolReader(engine, replica)
        self._requests = engine.subscribe_requests()
        self._records: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)
        self._usage_samples: deque[tuple[float, float, float]] = deque(maxlen=HISTORY_SAMPLES)
        self._arrivals: dict[str, float] = {}
        self._evictions: deque[Evictions] = deque(maxlen=HISTORY_SAMPLES)
        self._evicted = (None, 0)  # (pool epoch, its eviction count at the last refresh)
        self._blocks_seen = (None, 0)  # ((epoch, blocks version), the step then)
        self.history = PoolHistory()  # the pool after each delta, for the step scrubber
        self._past: tuple[int, PoolMirror, PoolMirror | None] | None = None  # the last asked
        self.lock = threading.RLock()  # held by a reader across refresh() and its reads
        self._decode = lru_cache(maxsize=65536)(self._decode_uncached)

    def refresh(self) -> LiveState:
        with self.lock:
            now = time.time()
            snapshot = self._pool.update(FIRST_SNAPSHOT_WAIT_S, self.history)
            replica = self._pool.replica
            self._records.extend(r for r in self._steps.drain() if r.replica == replica)
            # Arrival times give the timelines their waiting bars and the stats their TTFT:
            # from finished requests, and from running ones seen in the mirror.
            for record in self._requests.drain():
                if record.replica != replica:
                    continue
                metrics = record.output.metrics
                if metrics is not None:
                    self._arrivals[record.output.request_id] = metrics.arrival_time
            for seq in snapshot.sequences:
                self._arrivals.setdefault(seq.request_id, seq.arrival_time)
            num_blocks = max(snapshot.num_blocks, 1)
            self._usage_samples.append((
                now, int(np.count_nonzero(snapshot.ref_counts)) / num_blocks,
                snapshot.num_used_tokens / (num_blocks * snapshot.block_size)))
            oldest = self._records[0].start_time if self._records else now
            self._arrivals = {r: t for r, t in self._arrivals.items() if t >= oldest - 60}
            self._count_evictions(snapshot)
            # The heatmap names the step its picture is of; this step moves only when the
            # blocks do, so an unchanged picture is still neither resent nor redrawn.
            version = (snapshot.epoch, snapshot.blocks_version)
            if version != self._blocks_seen[0]:
                self._blocks_seen = (version, snapshot.step)
            counters = self.engine.replica_statuses()[replica].counters
            slots = (self.engine.state_slot_table(replica)
                     if self.engine.memory_plan.bytes_per_state_slot else None)
            return LiveState(snapshot, tuple(self._records), tuple(self._usage_samples),
                             dict(self._arrivals), now, replica, counters,
                             tuple(self._evictions), self._blocks_seen[1], slots=slots)

    def state_at(self, frame: int | None) -> LiveState:
        """The panels' state as it was after a recorded frame (clamped to the frames kept;
        None: the latest frame), drawn from the records of the steps done by then. The
        live state while no frame is recorded yet."""
        live = self.refresh()
        with self.lock:
            number = self.history.clamp(frame)
            if number is None:
                return live
            if self._past is None or self._past[0] != number:
                before = (self.history.mirror_at(number - 1)
                          if number > self.history.first else None)
                self._past = (number, self.history.mirror_at(number), before)
            _, pool, before = self._past
            shown = self.history.frame(number)
        step = shown.step  # steps done by then: records of steps 0 .. step - 1
        return LiveState(pool, tuple(r for r in live.records if r.step < step),
                         tuple(u for u in live.usage_samples if u[0] <= shown.time),
                         live.arrivals, shown.time, live.replica, None,
                         tuple(e for e in live.evictions if e.step < step), step, shown,
                         before)

    def _count_evictions(self, snapshot: PoolMirror) -> None:
        """The pool counts evictions since it was built; the event log wants them per step."""
        epoch, count = self._evicted
        if snapshot.epoch == epoch and snapshot.num_evictions > count:
            step = self._records[-1].step if self._records else snapshot.step
            self._evictions.append(Evictions(step, snapshot.num_evictions - count))
        self._evicted = (snapshot.epoch, snapshot.num_evictions)

    @property
    def replica(self) -> int:
        """The engine replica the panels show (always 0 for a single engine)."""
        return self._pool.replica

    def clear(self) -> None:
        """After a reconfigure the old history describes a pool that no longer exists."""
        with self.lock:
            self._records.clear()
            self._usage_samples.clear()
            self._evictions.clear()
            self.history = PoolHistory()
            self._past = None

    def decode(self, token_ids: tuple[int, ...]) -> str:
        return self._decode(token_ids)

    def _decode_uncached(self, token_ids: tuple[int, ...]) -> str:
        return self.engine.tokenizer.decode(list(token_ids), skip_special_tokens=False)


class LiveFeeds:
    """One LiveFeed per engine replica, made when a tab first shows that replica: each
    tab chooses its replica (a ReplicaSet has several; a single engine has replica 0)."""

    def __init__(self, engine: EngineView):
        self.engine = engine
        self._feeds: dict[int, LiveFeed] = {}
        self._lock = threading.Lock()

    def get(self, replica: int = 0) -> LiveFeed:
        if not 0 <= replica < self.engine.num_replicas:
            raise ValueError(f"replica={replica} must be in [0, {self.engine.num_replicas})")
        with self._lock:
            if replica not in self._feeds:
                self._feeds[replica] = LiveFeed(self.engine, replica)
            return self._feeds[replica]

    def clear(self) -> None:
        """After a reconfigure (see LiveFeed.clear)."""
        with self._lock:
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.clear()
