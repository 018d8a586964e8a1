"""AsyncEngine: EngineCore on its own thread, with request streams, abort, reconfigure and feeds."""

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_events import AllBlocksCleared, KVEventSink
from kvscope.engine.core.kv_offload.tier import TierTotals
from kvscope.engine.core.kv_offload.transfer_sizes import TransferSizes
from kvscope.engine.core.request import ChunkKind
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.orchestrator import heap
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.orchestrator.engine_thread import EngineThread
from kvscope.engine.orchestrator.served import ServedEngine, ServedModel
from kvscope.engine.orchestrator.streams import (
    Channel,
    EngineClosed,
    Feed,
    RequestFailed,
    RequestStream,
    settle_future,
)
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.experts import step_counts
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.pool_recorder import PoolRecorder
from kvscope.engine.telemetry.records import EngineSnapshot, StepRecord
from kvscope.engine.worker.memory import MemoryPlan

logger = logging.getLogger(__name__)
# Knobs that would need the weights reloaded; reconfigure only rebuilds the KV cache.
RELOAD_KNOBS = ("model", "dtype", "device", "quantization", "quantization_group_size",
                "enforce_eager")
# Blocks per snapshot slice: a few milliseconds of the engine thread at most.
POOL_SLICE_BLOCKS = 32_768
# Pool records a reader may fall behind by before the oldest are dropped (it resyncs).
POOL_CHANNEL_RECORDS = 4096


def _check_replica(replica: int | None) -> None:
    if replica not in (None, 0):
        raise ValueError(f"replica={replica}: this engine is one replica, number 0")


@dataclass(slots=True)
class EngineCounters:
    """Totals since the AsyncEngine started; they survive reconfigures (monotonic)."""

    num_steps: int = 0
    step_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)  # PreemptionReason
    swapped_out: int = 0
    swapped_in: int = 0
    prefix_cache_queries: int = 0  # tokens, as vLLM counts them
    prefix_cache_hits: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    # Speculative decoding (vLLM's counts): proposals verified, their tokens, the tokens
    # accepted, and per position in the proposals (0 first) how often it was accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: dict[int, int] = field(default_factory=dict)
    # A mixture-of-experts model's routing (engine.telemetry.experts): per decoder layer,
    # the tokens each expert took (int64 [experts]), and the bytes the chosen experts read
    # against the bytes all experts hold, summed over steps.
    moe_expert_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    moe_expert_bytes_read: int = 0
    moe_expert_bytes_all: int = 0
    # The disk tier (engine.core.kv_offload.tier.TierTotals: vLLM's names), summed over cores.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_bytes: dict[str, int] = field(default_factory=dict)  # by transfer type
    kv_offload_seconds: dict[str, float] = field(default_factory=dict)
    kv_offload_sizes: dict[str, TransferSizes] = field(default_factory=dict)
    kv_offload_loads: int = 0  # prefix loads from the tier: the DISK_to_GPU seconds are theirs
    # What the tier holds at the last step (gauges, not totals): blocks, bytes, its size.
    kv_tier_blocks: int = 0
    kv_tier_bytes: int = 0
    kv_tier_capacity_bytes: int = 0


@dataclass(slots=True)
class ReplicaStatus:
    """One engine replica as /health, /metrics and the dashboard see it (a single engine
    is replica 0; engine.replicas.ReplicaSet reports one per Ray actor)."""

    replica: int
    alive: bool
    error: str | None  # why it is down
    restarts: int
    in_flight: int  # requests routed to it and not finished
    kv_usage: float  # fraction of its KV blocks in use at its last step
    counters: EngineCounters
    num_indexed_blocks: int = 0  # block hashes the router's prefix index has for it


@dataclass(slots=True)
class RequestRecord:
    """A finished (or aborted, or failed) request, for readers such as metrics and logs."""

    output: RequestOutput
    source: str
    finish_reason: str  # the first sample's, or "error"
    inter_token_latencies: list[float]  # seconds between consecutive steps with new tokens
    error: str | None = None
    replica: int = 0  # which engine replica served it (engine.replicas)
    # The params the core ran it with (the session log keeps them so a replay can rerun it).
    params: SamplingParams | BeamSearchParams | None = None


@dataclass(slots=True)
class _LiveRequest:
    """Engine-thread bookkeeping of one request between add and finish."""

    stream: RequestStream
    params: SamplingParams | BeamSearchParams | None = None
    num_tokens_seen: int = 0
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _PoolSnapshotJob:
    """A full pool snapshot on its way to one reader, a slice per engine-loop turn."""

    channel: Channel
    epoch: int | None = None  # the pool being sent; None until the PoolBase goes out
    next_start: int = 0


@dataclass(slots=True)
class _PendingReconfigure:
    config: EngineConfig
    result: concurrent.futures.Future


def _slot_table(core: EngineCore) -> SlotTable | None:
    slots = core.kv_cache.state_slots
    return None if slots is None else slots.table()


def _log_loop_crash(loop: concurrent.futures.Future) -> None:
    if loop.exception() is not None:
        logger.error("the engine loop crashed", exc_info=loop.exception())


class AsyncEngine(ServedEngine):
    """Runs an EngineCore on a background thread; other threads only enqueue commands.

    The thread steps while requests are unfinished and sleeps on a condition when idle.
    An EngineView (engine.entrypoints.view) of one replica, number 0, that routes nothing.
    """

    def __init__(self, core: EngineCore, base_config: EngineConfig | None = None) -> None:
        self._core = core
        self._served = ServedModel.of(core)  # a core serves one config and pool for life
        self._recorder = PoolRecorder(core).listen()
        self._kv_listeners: list[KVEventSink] = []
        # Reconfigure applies knobs to the unresolved config, so derived knobs (the token
        # budget, max_model_len) are derived again for the new values.
        self._base_config = base_config or core.config
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._live: dict[str, _LiveRequest] = {}
        # Adds waiting out a reconfigure: request id -> (stream, the add to replay).
        self._held: dict[str, tuple[RequestStream, Callable[[], None]]] = {}
        self._reconfigure: _PendingReconfigure | None = None
        self._reconfigure_lock = threading.Lock()
        self._snapshot_waiters: list[concurrent.futures.Future] = []
        self._pool_jobs: list[_PoolSnapshotJob] = []
        self._pool_feed = Feed()
        self._step_feed = Feed()
        self._request_feed = Feed()
        self._counters = EngineCounters()
        self._tier_seen: tuple[object, TierTotals] = (None, TierTotals())  # (core, its totals)
        self._last_step: StepRecord | None = None
        # Replaced (never changed) on the engine thread with each pool delta, so a reader
        # takes it whole without waiting for a step to end.
        self._slot_table = _slot_table(core)
        self._counters_lock = threading.Lock()
        self._request_ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._exited = False
        self._thread = EngineThread()
        self._loop: concurrent.futures.Future | None = None  # _run's, once started

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Load the model and build the engine (not started)."""
        return cls(EngineCore(config), base_config=config)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        heap.freeze_long_lived()  # the pool's blocks and the model are here to stay
        self._loop = self._thread.call(self._run)
        self._loop.add_done_callback(_log_loop_crash)
        self._thread.finish()
        return self

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._loop.done()

    def shutdown(self, abort_running: bool = True, timeout: float | None = 30.0) -> None:
        """Stop taking requests, abort (or finish) the ones in flight, stop the thread."""
        self._accepting = False
        if self._loop is None:  # never started: the thread only waits for calls
            self._thread.finish()
            return
        if self._loop.done():
            return
        self._enqueue(lambda: self._do_stop(abort_running))
        self._thread.join(timeout)
        heap.thaw()  # this engine's pool may be collected once dropped
        if self._thread.is_alive():
            logger.warning("engine thread still busy after %.0f s", timeout)

    # ---- what the engine serves ---------------------------------------------------------
    @property
    def served(self) -> ServedModel:
        """The model and pool the current core runs (a new core after each reconfigure)."""
        return self._served

    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def is_reconfiguring(self) -> bool:
        """True from the reconfigure() call until the new pool is in place (or refused)."""
        return self._reconfigure_lock.locked()

    num_replicas = 1
    routing = None  # one engine: nothing to route
    routing_load_weight = None
    recent_decisions: tuple = ()  # of routing decisions

    def set_routing(self, policy: str | None = None, load_weight: float | None = None) -> None:
        raise ValueError("routing: one engine serves every request; routing needs "
                         "--replicas 2 or more")

    def subscribe_decisions(self, maxsize: int = 1024) -> Channel:
        """An open channel that stays empty: one engine makes no routing decisions."""
        return Channel(maxsize)

    def router_view(self, timeout: float | None = 10.0) -> None:
        """None: one engine has no router whose belief to compare."""
        return None

    def replica_statuses(self) -> list[ReplicaStatus]:
        step, num_blocks = self._last_step, self._core.memory_plan.num_blocks
        return [ReplicaStatus(0, self.is_running, None, 0, len(self._live),
                              step.num_used_blocks / num_blocks if step else 0.0,
                              self.counters())]

    def counters(self) -> EngineCounters:
        """A consistent copy of the totals."""
        with self._counters_lock:
            return replace(self._counters,
                           requests_finished=dict(self._counters.requests_finished),
                           kv_offload_bytes=dict(self._counters.kv_offload_bytes),
                           kv_offload_seconds=dict(self._counters.kv_offload_seconds),
                           kv_offload_sizes=dict(self._counters.kv_offload_sizes),
                           spec_decode_num_accepted_tokens_per_pos=dict(
                               self._counters.spec_decode_num_accepted_tokens_per_pos),
                           moe_expert_tokens={layer: tokens.copy() for layer, tokens
                                              in self._counters.moe_expert_tokens.items()})

    # ---- requests ----------------------------------------------------------------------
    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        request_id: str | None = None,
        source: str = "api",
        priority: int = 0,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream at once (never blocks on the engine).

        Bad input surfaces from `stream.wait_accepted()` / `await stream.accepted()` or
        from iterating the stream, as the engine's ValueError naming the knob.
        """
        if not self._accepting:
            raise EngineClosed("the engine is shutting down; it takes no new requests")
        request_id = request_id or f"{source}-{next(self._request_ids)}"
        stream = RequestStream(request_id, source, on_abort=lambda: self.abort(request_id))
        self._enqueue(lambda: self._do_add(stream, prompt, params, priority,
                                           add_special_tokens, time.time(), cache_salt))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary; unknown or finished ids are ignored."""
        self._enqueue(lambda: self._do_abort(request_id))

    # ---- readers -----------------------------------------------------------------------
    def snapshot_records(self) -> concurrent.futures.Future:
        """A future of the pool's records (a base and one slice of the whole pool) taken on
        the engine thread between steps; a PoolMirror built from them is the snapshot."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(lambda: self._snapshot_waiters.append(future))
        return future

    def snapshot(self, timeout: float | None = 10.0, replica: int | None = None) -> EngineSnapshot:
        """The pool and queues at one instant between steps (a mirror of them, built on
        the calling thread)."""
        _check_replica(replica)
        return PoolMirror.of(self.snapshot_records().result(timeout)).snapshot()

    async def snapshot_async(self, replica: int | None = None) -> EngineSnapshot:
        _check_replica(replica)
        records = await asyncio.wrap_future(self.snapshot_records())
        return await asyncio.to_thread(lambda: PoolMirror.of(records).snapshot())

    def state_slot_table(self, replica: int | None = None) -> SlotTable | None:
        """The recurrent layers' state slots as of the last pool delta (None: the model
        has no recurrent layers). Not in the pool records, so not in saved sessions."""
        _check_replica(replica)
        return self._slot_table

    def subscribe_steps(self, maxsize: int = 1024) -> Channel:
        """Every StepRecord from now on; past `maxsize` unread, the oldest are dropped."""
        return self._step_feed.subscribe(maxsize)

    def subscribe_pool(self, maxsize: int = POOL_CHANNEL_RECORDS,
                       replica: int | None = None) -> Channel:
        """Records for a kvscope.engine.telemetry.pool_mirror.PoolMirror: a full snapshot (a PoolBase, then
        PoolSlices, interleaved with deltas), then one PoolDelta per step. Past `maxsize`
        unread the oldest are dropped: the reader then calls resync_pool."""
        _check_replica(replica)
        channel = self._pool_feed.subscribe(maxsize)
        self.resync_pool(channel)
        return channel

    def resync_pool(self, channel: Channel) -> None:
        """Send this subscriber a fresh full snapshot (it missed a delta)."""
        self._enqueue(lambda: self._pool_jobs.append(_PoolSnapshotJob(channel)))

    def subscribe_kv_events(self, listener: KVEventSink) -> None:
        """Call `listener` with every event of the core's pool from now on (on the engine
        thread, so it must be cheap), across reconfigures: a rebuilt pool starts with
        AllBlocksCleared. Subscribe before start() to miss nothing."""
        self._kv_listeners.append(listener)
        self._core.events.subscribe(listener)

    def subscribe_requests(self, maxsize: int = 10_000) -> Channel:
        """A RequestRecord for every request that ends from now on."""
        return self._request_feed.subscribe(maxsize)

    # ---- reconfigure -------------------------------------------------------------------
    def reconfigure(self, abort_running: bool = False, timeout: float | None = None,
                    **knobs: Any) -> MemoryPlan:
        """Rebuild the KV cache with new knobs, keeping the weights; returns the new plan.

        New requests wait meanwhile; running ones finish (or are aborted with
        `abort_running`). Invalid knobs raise ValueError and change nothing.
        """
        reload = sorted(set(knobs) & set(RELOAD_KNOBS))
        if reload:
            raise ValueError(f"{reload[0]}: changing {reload} reloads the weights; "
                             "restart the app instead")
        with self._reconfigure_lock:
            config = self._base_config.with_changes(**knobs)
            config.resolved(self._core.runner.max_positions)  # length knobs fail fast here
            pending = _PendingReconfigure(config, concurrent.futures.Future())
            self._enqueue(lambda: self._do_reconfigure(pending, abort_running))
            return pending.result.result(timeout)

    # ---- the engine thread -------------------------------------------------------------
    def _enqueue(self, command: Callable[[], None]) -> None:
        with self._wakeup:
            if self._exited:
                raise EngineClosed("the engine thread has stopped")
            self._commands.append(command)
            self._wakeup.notify()

    def _run(self) -> None:
        logger.info("engine thread started")
        while True:
            with self._wakeup:
                self._wakeup.wait_for(lambda: self._commands or self._has_work())
                commands = list(self._commands)
                self._commands.clear()
                # Commands that arrive after the last drain are refused by _enqueue.
                self._exited = self._stopping and not self._core.has_unfinished_requests()
            for command in commands:
                self._guarded(command)
            if self._recorder.pending:  # aborts between steps freed blocks
                self._guarded(self._publish_pool_delta)
            if self._pool_jobs:
                self._guarded(self._send_pool_slices)
            if self._snapshot_waiters:
                self._guarded(self._answer_snapshots)
            if self._exited:
                self._guarded(self._core.close)  # the disk tier saves what it lacks
                break
            if self._core.has_unfinished_requests():
                self._step()
            if self._reconfigure is not None and not self._core.has_unfinished_requests():
                self._guarded(self._rebuild)
        for request_id in list(self._held):
            self._refuse_held(request_id, EngineClosed("the engine stopped before it ran"))
        if self._reconfigure is not None:
            settle_future(self._reconfigure.result, error=EngineClosed("the engine stopped"))
        logger.info("engine thread stopped")

    def _has_work(self) -> bool:
        return self._core.has_unfinished_requests() or bool(self._pool_jobs) or (
            self._reconfigure is not None or self._stopping)

    def _guarded(self, command: Callable[[], None]) -> None:
        """A bug in one command must not kill the thread every stream depends on."""
        try:
            command()
        except Exception:
            logger.exception("engine command failed")

    def _do_add(self, stream: RequestStream, prompt, params, priority: int,
                add_special_tokens: bool, arrival_time: float,
                cache_salt: str | None) -> None:
        if self._reconfigure is not None or self._stopping:
            self._held[stream.request_id] = (stream, lambda: self._do_add(
                stream, prompt, params, priority, add_special_tokens, arrival_time,
                cache_salt))
            return
        try:
            request = self._core.add_request(
                prompt, params, request_id=stream.request_id, arrival_time=arrival_time,
                priority=priority, source=stream.source, add_special_tokens=add_special_tokens,
                cache_salt=cache_salt)
        except Exception as error:  # noqa: BLE001 -- ValueError for bad input; others refuse too
            stream.fail(error)
            return
        recorded = request.beam.params if request.beam is not None else request.params
        self._live[stream.request_id] = _LiveRequest(stream, recorded)
        stream.accept()

    def _do_abort(self, request_id: str) -> None:
        if request_id in self._held:
            self._refuse_held(request_id, RequestFailed("aborted before it started"))
            return
        output = self._core.abort_request(request_id)
        if output is not None:
            self._deliver(output, time.time())

    def _refuse_held(self, request_id: str, error: Exception) -> None:
        """End a request that never reached the core (aborted, or the engine stopped)."""
        stream, _ = self._held.pop(request_id)
        stream.fail(error)

    def _step(self) -> None:
        core = self._core
        try:
            result = core.step(on_scheduled=self._publish_prefill)
        except Exception as error:  # noqa: BLE001 -- the failure goes to the step's requests
            self._fail_step(error)
            self._publish_pool_delta()
            return
        now = time.time()
        self._last_step = result.record
        self._count_step(result.record)
        for output in result.outputs:
            self._deliver(output, now)
        self._publish_pool_delta()
        self._step_feed.publish(result.record)

    def _publish_pool_delta(self) -> None:
        self._pool_feed.publish(self._recorder.take_delta())
        self._slot_table = _slot_table(self._core)

    def _publish_prefill(self, plan: SchedulerOutput) -> None:
        """Before a step that prefills runs: readers (dashboard, /metrics) see the
        admitted prompt running with this chunk's blocks while the step computes, which
        for a long prompt is seconds. Decode-only steps publish once, after the step."""
        if any(item.kind is ChunkKind.PREFILL for item in plan.scheduled):
            self._publish_pool_delta()

    def _send_pool_slices(self) -> None:
        """One slice of each pending snapshot, so no turn of the loop pauses for long."""
        recorder = self._recorder
        for job in list(self._pool_jobs):
            if job.channel.closed:
                self._pool_jobs.remove(job)
                continue
            if job.epoch != recorder.epoch:  # a new reader, or the pool was rebuilt meanwhile
                if recorder.pending:
                    self._publish_pool_delta()  # the base is the state after this delta
                job.channel.put(recorder.take_base())
                job.epoch, job.next_start = recorder.epoch, 0
            job.channel.put(recorder.take_slice(job.next_start, POOL_SLICE_BLOCKS))
            job.next_start += POOL_SLICE_BLOCKS
            if job.next_start >= self._core.kv_cache.pool.num_blocks:
                self._pool_jobs.remove(job)

    def _fail_step(self, error: Exception) -> None:
        """Abort the requests the failed step ran (all, if it got as far as none)."""
        core = self._core
        running = {seq.request.request_id for seq in core.scheduler.running}
        failed = running or set(core.requests)
        logger.exception("engine step %d failed; failing %d request(s)", core.step_index,
                         len(failed), exc_info=error)
        with self._counters_lock:
            self._counters.step_failures += 1
        message = f"engine step failed: {type(error).__name__}: {error}"
        for request_id in failed:
            try:
                output = core.abort_request(request_id)
            except Exception:
                logger.exception("aborting %s after a failed step", request_id)
                output = None
            live = self._live.pop(request_id, None)
            if live is None:
                continue
            live.stream.fail(RequestFailed(message))
            if output is not None:
                output.error = message
                self._publish_request(output, live, "error")

    def _deliver(self, output: RequestOutput, now: float) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        num_tokens = sum(len(sample.token_ids) for sample in output.outputs)
        if num_tokens > live.num_tokens_seen:
            if live.num_tokens_seen == 0:
                with self._counters_lock:
                    self._counters.prompt_tokens += len(output.prompt_token_ids)
            if live.last_token_time is not None:
                live.inter_token_latencies.append(now - live.last_token_time)
            live.num_tokens_seen, live.last_token_time = num_tokens, now
        if output.finished:
            # Published before the stream sees the end, so whoever answers the client can
            # have the record logged first (storage.SessionRecorder.sync).
            del self._live[output.request_id]
            self._publish_request(output, live, output.outputs[0].finish_reason or "abort")
        live.stream.push(output)

    def _publish_request(self, output: RequestOutput, live: _LiveRequest,
                         finish_reason: str) -> None:
        with self._counters_lock:
            finished = self._counters.requests_finished
            finished[finish_reason] = finished.get(finish_reason, 0) + 1
        record = RequestRecord(output, live.stream.source, finish_reason,
                               live.inter_token_latencies, output.error, params=live.params)
        self._request_feed.publish(record)

    def _count_tier(self, counters: EngineCounters) -> None:
        """Add what the disk tier counted since the last step (a new core's tier counts
        from zero)."""
        tier = self._core.kv_tier
        held = (tier.store.num_blocks, tier.store.num_bytes, tier.store.capacity_bytes) \
            if tier is not None else (0, 0, 0)
        (counters.kv_tier_blocks, counters.kv_tier_bytes,
         counters.kv_tier_capacity_bytes) = held
        if tier is None:
            return
        now = tier.totals()
        core, before = self._tier_seen
        if core is not self._core:
            before = TierTotals()
        self._tier_seen = (self._core, now)
        counters.external_prefix_cache_queries += now.queries - before.queries
        counters.external_prefix_cache_hits += now.hits - before.hits
        counters.kv_offload_loads += now.loads - before.loads
        for kind in now.bytes:
            counters.kv_offload_bytes[kind] = (counters.kv_offload_bytes.get(kind, 0)
                                               + now.bytes[kind] - before.bytes.get(kind, 0))
            counters.kv_offload_seconds[kind] = (counters.kv_offload_seconds.get(kind, 0.0)
                                                 + now.seconds[kind]
                                                 - before.seconds.get(kind, 0.0))
            counters.kv_offload_sizes[kind] = (counters.kv_offload_sizes.get(kind, TransferSizes())
                                               + now.sizes[kind]
                                               - before.sizes.get(kind, TransferSizes()))

    def _count_step(self, record: StepRecord) -> None:
        with self._counters_lock:
            counters = self._counters
            counters.num_steps += 1
            counters.generation_tokens += record.num_generated_tokens
            counters.preemptions += len(record.preempted)
            by_reason = counters.preemptions_by_reason
            for _, reason, *_ in record.preemptions:
                by_reason[reason] = by_reason.get(reason, 0) + 1
            counters.swapped_out += len(record.swapped_out)
            counters.swapped_in += len(record.swapped_in)
            counters.prefix_cache_queries += record.prefix_cache_queries
            counters.prefix_cache_hits += record.prefix_cache_hits
            per_pos = counters.spec_decode_num_accepted_tokens_per_pos
            for _, num_draft_tokens, num_accepted in record.spec_drafts:
                counters.spec_decode_num_drafts += 1
                counters.spec_decode_num_draft_tokens += num_draft_tokens
                counters.spec_decode_num_accepted_tokens += num_accepted
                for position in range(num_accepted):  # accepted tokens are a prefix
                    per_pos[position] = per_pos.get(position, 0) + 1
            self._count_tier(counters)
            counters.moe_expert_bytes_read += record.expert_bytes_read
            counters.moe_expert_bytes_all += record.expert_bytes_all
            experts = counters.moe_expert_tokens
            for layer, tokens in zip(record.expert_layers, step_counts(record)):
                if layer in experts:
                    experts[layer] += tokens
                else:
                    experts[layer] = tokens

    def _answer_snapshots(self) -> None:
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        try:
            records = self._recorder.take_full()
        except Exception as error:
            for waiter in waiters:
                settle_future(waiter, error=error)
            raise
        for waiter in waiters:
            settle_future(waiter, records)

    def _do_reconfigure(self, pending: _PendingReconfigure, abort_running: bool) -> None:
        self._reconfigure = pending
        if abort_running:
            for request_id in list(self._core.requests):
                self._do_abort(request_id)
        logger.info("reconfiguring: waiting for %d request(s) to finish",
                    len(self._core.requests))

    def _rebuild(self) -> None:
        """Swap in a core with the new config (the pool is idle); replay the held adds."""
        pending, self._reconfigure = self._reconfigure, None
        old = self._core
        runner = old.runner
        # A weak reference: holding the old tensor would double peak memory while the
        # new one is allocated.
        old_cache = weakref.ref(runner.kv_cache)
        if old.kv_tier is not None:  # the new pool starts empty; the tier keeps what this one cached
            old.kv_tier.flush()
        try:
            core = EngineCore(pending.config, runner=runner)
        except Exception as error:  # noqa: BLE001 -- handed to the caller of reconfigure()
            if runner.kv_cache is None or runner.kv_cache is not old_cache():
                # Profiling the new budget replaced the cache tensor: give the old core a
                # fresh one.
                old.reallocate_caches()
            logger.warning("reconfigure refused: %s", error)
            settle_future(pending.result, error=error)
        else:
            if old.kv_tier is not None:
                old.kv_tier.stop()
            core.step_index = old.step_index  # readers see one step sequence across configs
            self._core, self._served, self._base_config = (core, ServedModel.of(core),
                                                           pending.config)
            self._recorder = PoolRecorder(core).listen()
            for listener in self._kv_listeners:  # the old pool's cache went with it
                listener(AllBlocksCleared())
                core.events.subscribe(listener)
            self._publish_pool_delta()  # delta 0 of the new pool: readers start it empty
            logger.info("reconfigured: %s", core.memory_plan.describe())
            settle_future(pending.result, core.memory_plan)
        old = core = None
        heap.rebase()  # one full collection per reconfigure, none per step
        held, self._held = list(self._held.values()), {}
        for _, add in held:
            add()

    def _do_stop(self, abort_running: bool) -> None:
        self._stopping = True
        if abort_running:
            for request_id in list(self._core.requests):
                self._do_abort(request_id)
