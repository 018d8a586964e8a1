"""EngineReplica: the body of one Ray actor, owning one AsyncEngine (weights, pool,
scheduler, engine thread) and streaming its outputs and events to the API process."""

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.orchestrator.async_engine import AsyncEngine, EngineCounters, RequestRecord
from kvscope.engine.orchestrator.served import ServedModel
from kvscope.engine.orchestrator.streams import Channel
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import EngineSnapshot, PoolBase, PoolDelta, StepRecord
from kvscope.engine.worker.memory import MemoryPlan

logger = logging.getLogger(__name__)
# Records a replica keeps for the API process between two polls; past this the oldest go.
EVENT_BACKLOG = 50_000


@dataclass(slots=True)
class ReplicaInfo:
    """What the API process learns about a replica when it is (re)started."""

    replica: int
    pid: int
    node: str
    served: ServedModel


@dataclass(slots=True)
class ReplicaEvents:
    """What happened on a replica since the last poll.

    `stored` / `evicted` are the block hashes (the value of a BlockHash, the prefix cache's chained
    hash) that entered or left the replica's pool; the router's prefix index applies them,
    evictions first. A batch spans many pool records, so each hash is kept once, as its
    last change (`blocks`: hash -> stored): a block stored in one step and evicted in a
    later one must leave the index evicted.
    `pool` holds the pool records (kvscope.engine.telemetry.records) for the API process's mirrors, while
    one is watching this replica.
    """

    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    blocks: dict[bytes, bool] = field(default_factory=dict)
    pool: list = field(default_factory=list)
    counters: EngineCounters | None = None
    event_seq: int = 0  # the replica's stored + evicted count through this batch

    @property
    def stored(self) -> list[bytes]:
        return [block_hash for block_hash, stored in self.blocks.items() if stored]

    @property
    def evicted(self) -> list[bytes]:
        return [block_hash for block_hash, stored in self.blocks.items() if not stored]

    def add_blocks(self, evicted: list[bytes], stored: list[bytes]) -> None:
        """One pool record's changes, evictions first (a reused block's old hash leaves
        before its new one enters)."""
        for block_hash in evicted:
            self.blocks.pop(block_hash, None)  # re-inserted last: the order of changes
            self.blocks[block_hash] = False
        for block_hash in stored:
            self.blocks.pop(block_hash, None)
            self.blocks[block_hash] = True


@dataclass(frozen=True, slots=True)
class CachedPrefixes:
    """What a replica's prefix cache holds (the hashes of every block with content, in
    use or cached-free) and its count of block events so far: the router's index
    compares its belief with this."""

    replica: int
    hashes: frozenset[bytes]
    event_seq: int


class BlockHashTracker:
    """Follows the engine's pool records (a PoolMirror) and turns each change of a block's
    hash into stored / evicted events. A new pool (a reconfigure, or a resync after a
    missed delta) evicts every hash the old one held."""

    def __init__(self) -> None:
        self.mirror = PoolMirror()
        self.event_seq = 0  # stored + evicted events emitted so far

    def apply(self, record, events: ReplicaEvents) -> bool:
        """False when the record cannot be applied: ask the engine for a new snapshot."""
        mirror = self.mirror
        if isinstance(record, PoolDelta) and record.epoch == mirror.epoch:
            touched = [block_id for block_id, _, _ in record.blocks]
        elif isinstance(record, PoolBase) or isinstance(record, PoolDelta):
            touched = range(mirror.num_blocks)  # the whole old pool goes
        else:  # a PoolSlice
            touched = range(record.start, record.start + len(record.ref_counts))
        before = {i: mirror.hashes[i] for i in touched if i < mirror.num_blocks}
        applied = mirror.apply(record)
        if isinstance(record, PoolDelta):
            touched = {*before, *(block_id for block_id, _, _ in record.blocks)}
        hashes = mirror.hashes
        evicted, stored = [], []
        for block_id in touched:
            old = before.get(block_id)
            new = hashes[block_id] if block_id < len(hashes) else None
            old_value, new_value = old and old[0], new and new[0]
            if old_value != new_value:
                if old_value is not None:
                    evicted.append(old_value)
                if new_value is not None:
                    stored.append(new_value)
        events.add_blocks(evicted, stored)
        self.event_seq += len(evicted) + len(stored)
        return applied


class EngineReplica:
    """Made remote by engine.replicas.ReplicaSet (ray.remote with per-replica resources).

    An async actor: `generate` streams one request's outputs (a Ray streaming generator),
    `next_events` long-polls the step / request / block-hash (and pool) events.
    """

    def __init__(self, replica: int, config: EngineConfig, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.replica = replica
        self.engine = AsyncEngine.from_config(config).start()
        self.steps = self.engine.subscribe_steps(EVENT_BACKLOG)
        self.finished = self.engine.subscribe_requests(EVENT_BACKLOG)
        self.tracker = BlockHashTracker()
        self.pool_records = self.engine.subscribe_pool(EVENT_BACKLOG)
        self.pool_dropped = 0
        # Block events tracked between two polls (a cached_prefixes call catches up).
        self.untold = ReplicaEvents()
        self.forwarded: Channel | None = None  # pool records for the API process's mirrors

    def info(self) -> ReplicaInfo:
        import ray  # the actor runs under Ray; the module stays importable without it

        return ReplicaInfo(self.replica, os.getpid(), ray.get_runtime_context().get_node_id(),
                           self.engine.served)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int, add_special_tokens: bool, source: str,
                       cache_salt: str | None):
        """Yields None once the engine accepted the request (or the ValueError refusing
        it), then every RequestOutput; a failed step ends it with its RequestFailed."""
        stream = self.engine.submit(prompt, params, request_id=request_id, source=source,
                                    priority=priority, add_special_tokens=add_special_tokens,
                                    cache_salt=cache_salt)
        try:
            await stream.accepted()
        except ValueError as error:
            yield error
            return
        yield None
        try:
            async for output in stream:
                yield output
        except Exception as error:  # noqa: BLE001 -- a failed step: handed to the client
            yield error
        finally:
            stream.abort()  # the client went away (the generator was closed) mid-stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def watch_pool(self) -> None:
        """Forward pool records from now on, starting with a full snapshot (again, when
        called again: a reader on the API side missed a record)."""
        if self.forwarded is None:
            self.forwarded = self.engine.subscribe_pool(EVENT_BACKLOG)
        else:
            self.engine.resync_pool(self.forwarded)

    async def next_events(self, wait_s: float) -> ReplicaEvents:
        """Events since the last call, waiting up to `wait_s` for a step if none came."""
        events = ReplicaEvents()
        try:
            first = await asyncio.wait_for(self.steps.aget(), wait_s)
            events.steps.append(first)
        except (TimeoutError, StopAsyncIteration):
            pass
        events.steps.extend(self.steps.drain())
        events.steps = [dataclasses.replace(step, replica=self.replica) for step in events.steps]
        events.requests = [dataclasses.replace(record, replica=self.replica)
                           for record in self.finished.drain()]
        # After the wait, in one go: a cached_prefixes call during it tracked the records
        # published so far, whose events come before the ones tracked now.
        events.blocks, self.untold = self.untold.blocks, ReplicaEvents()
        self._track_blocks(events)
        events.event_seq = self.tracker.event_seq
        if self.forwarded is not None:
            events.pool = self.forwarded.drain()
        events.counters = self.engine.counters()
        return events

    def _track_blocks(self, events: ReplicaEvents) -> None:
        records = self.pool_records
        missed = records.num_dropped != self.pool_dropped
        self.pool_dropped = records.num_dropped
        for record in records.drain():
            if not self.tracker.apply(record, events):
                missed = True
                break
        if missed:
            self.tracker.mirror.awaiting_base = True
            self.engine.resync_pool(records)

    def cached_prefixes(self) -> CachedPrefixes:
        """The pool's hashes as of its last published step, and the event count through
        it: the pool records published so far are tracked (their events go out with the
        next poll). Read from the tracker's mirror, so the engine thread pays nothing
        however often the dashboard asks."""
        self._track_blocks(self.untold)
        mirror = self.tracker.mirror
        hashes = frozenset(block_hash[0] for block_hash in mirror.hashes[mirror.hashed])
        return CachedPrefixes(self.replica, hashes, self.tracker.event_seq)

    async def snapshot(self) -> EngineSnapshot:
        return dataclasses.replace(await self.engine.snapshot_async(), replica=self.replica)

    def state_slot_table(self) -> SlotTable | None:
        return self.engine.state_slot_table()

    async def reconfigure(self, abort_running: bool, knobs: dict) -> MemoryPlan:
        # Off the actor's event loop: the running requests' streams must keep flowing.
        return await asyncio.to_thread(self.engine.reconfigure, abort_running, **knobs)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown, True)
