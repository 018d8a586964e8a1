"""ReplicaSet: N engine replicas as Ray actors behind a router; an EngineView (engine.entrypoints.view)
like AsyncEngine, so the API, /metrics, /ws/events, the session log and the dashboard
serve it unchanged."""

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib.util
import itertools
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayError

import kvscope
from kvscope.engine.config import EngineConfig
from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.orchestrator.async_engine import (
    POOL_CHANNEL_RECORDS,
    RELOAD_KNOBS,
    EngineCounters,
    ReplicaStatus,
    RequestRecord,
)
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.served import ServedEngine, ServedModel
from kvscope.engine.orchestrator.streams import EngineClosed, Feed, RequestFailed, RequestStream
from kvscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.engine.replicas.hit_outcomes import HitLedger
from kvscope.engine.replicas.prefix_index import PrefixIndex, prompt_block_hashes
from kvscope.engine.replicas.replica import EngineReplica, ReplicaInfo
from kvscope.engine.replicas.router import ReplicaLoad, Router, RoutingDecision, check_load_weight
from kvscope.engine.replicas.router_view import RouterView, compare_index
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import EngineSnapshot, StepRecord
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path
from kvscope.engine.worker.memory import MemoryPlan

logger = logging.getLogger(__name__)
EVENT_POLL_S = 0.2  # how long a replica's event poll waits for a step before answering
RESTART_POLL_S = 0.5
RECENT_DECISIONS = 200
STOP_TIMEOUT_S = 30.0


class ReplicaDown(RequestFailed):
    """The replica serving the request died (its actor or process was killed)."""


@dataclass(slots=True, eq=False)
class _Routed:
    """A request in flight on a replica, with what it takes to record its end here when
    the replica dies before it can (the replica's own record dies with it)."""

    stream: RequestStream
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival_time: float
    last: RequestOutput | None = None  # the latest output the replica sent

    def failed_record(self, replica: int, message: str) -> RequestRecord:
        """The request as it stood when its replica died, ended like a failed step's
        (AsyncEngine._fail_step): unfinished samples aborted, the error kept."""
        now = time.time()
        last = self.last
        if last is None:
            params = self.params
            samples = params.beam_width if isinstance(params, BeamSearchParams) else params.n
            outputs = [CompletionOutput(i, "", []) for i in range(samples)]
            metrics = RequestMetrics(self.arrival_time)
            prompt = self.prompt if isinstance(self.prompt, str) else None
            last = RequestOutput(self.stream.request_id, prompt, self.prompt_token_ids,
                                 outputs, finished=False, metrics=metrics)
        outputs = [dataclasses.replace(c, finish_reason=c.finish_reason or "abort")
                   for c in last.outputs]
        metrics = dataclasses.replace(last.metrics or RequestMetrics(self.arrival_time),
                                      finished_time=now)
        output = dataclasses.replace(last, outputs=outputs, finished=True, metrics=metrics,
                                     error=message, deltas=[])
        return RequestRecord(output, self.stream.source, "error", [], message, replica,
                             self.params)


@dataclass(slots=True, eq=False)
class _Replica:
    index: int
    actor: Any
    info: ReplicaInfo | None = None
    alive: bool = False
    error: str | None = None
    restarts: int = 0
    streams: dict[str, _Routed] = field(default_factory=dict)
    pool_feed: Feed = field(default_factory=Feed)  # its pool records, while watched
    watched: bool = False
    last_step: StepRecord | None = None
    counters: EngineCounters = field(default_factory=EngineCounters)
    # The totals of earlier incarnations (a restarted actor counts from zero again).
    carried: EngineCounters = field(default_factory=EngineCounters)

    @property
    def kv_usage(self) -> float:
        step = self.last_step
        if step is None or self.info is None:
            return 0.0
        return step.num_used_blocks / max(1, self.info.served.memory_plan.num_blocks)


def add_counters(a: EngineCounters, b: EngineCounters) -> EngineCounters:
    total = EngineCounters()
    for name in (f.name for f in dataclasses.fields(EngineCounters)):
        left, right = getattr(a, name), getattr(b, name)
        if isinstance(left, dict):
            merged = dict(left)
            for key, value in right.items():
                merged[key] = merged.get(key, 0) + value
            setattr(total, name, merged)
        else:
            setattr(total, name, left + right)
    return total


def connect_ray(address: str | None = None) -> bool:
    """Join the Ray cluster at `address` (else start a local one) unless this process is
    connected already; True if it connected. The engine's packages travel with the job,
    so a cluster's nodes need only the dependencies (and the model at the same path)."""
    if ray.is_initialized():
        return False
    ray.init(address=address, logging_level=logging.WARNING,
             runtime_env={"py_modules": [shippable_package()]})
    return True


@functools.cache
def shippable_package() -> str:
    """kvscope as one folder for Ray's py_modules, with the parts a replica runs (engine/,
    kernels/) inside it: the repository keeps them beside kvscope/, not in it."""
    root = Path(tempfile.mkdtemp(prefix="kvscope-ray-")) / "kvscope"
    package = Path(kvscope.__file__).resolve().parent
    shutil.copytree(package, root, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("engine", "kernels"):
        source = Path(importlib.util.find_spec(f"kvscope.{part}").origin).parent
        shutil.copytree(source, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    return str(root)


def replica_resources(num_cpus: int) -> dict:
    """num_cpus threads per replica, and one GPU each when the cluster has GPUs."""
    gpus = ray.cluster_resources().get("GPU", 0)
    return {"num_cpus": num_cpus, "num_gpus": 1 if gpus >= 1 else 0}


class ReplicaSet(ServedEngine):
    """Starts `replicas` EngineReplica actors (joining the Ray cluster at `ray_address`,
    else the one this process is connected to, else a new local one) and routes requests
    to them. Public methods are thread-safe; Ray calls run on one event loop thread."""

    def __init__(self, config: EngineConfig, replicas: int, *, routing: str = "kv-aware",
                 load_weight: float = 1.0, ray_address: str | None = None,
                 restart_replicas: bool = False, replica_cpus: int = 1) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas={replicas!r} must be an integer >= 1")
        if isinstance(replica_cpus, bool) or not isinstance(replica_cpus, int) or replica_cpus < 1:
            raise ValueError(f"replica_cpus={replica_cpus!r} must be an integer >= 1")
        self._base_config = config
        self._knob_changes: dict[str, Any] = {}
        self.restart_replicas = restart_replicas
        self.index = PrefixIndex()
        self.router = Router(self.index, routing, load_weight)
        self.hits = HitLedger(self.index)  # predicted against actual prefix hits
        self.tokenizer = load_tokenizer(resolve_model_path(config.model))
        self._owns_ray = connect_ray(ray_address)
        self._step_feed, self._request_feed, self._decision_feed = Feed(), Feed(), Feed()
        self.recent_decisions: deque[RoutingDecision] = deque(maxlen=RECENT_DECISIONS)
        self._request_ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._reconfiguring = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvscope-replicas",
                                        daemon=True)
        self._thread.start()
        remote = ray.remote(EngineReplica).options(
            **replica_resources(replica_cpus), max_restarts=-1 if restart_replicas else 0,
            # The engine's packages travel with each actor, so a cluster's nodes need only
            # the dependencies (and the model at the same path).
            )
        self._replicas = [_Replica(i, remote.remote(i, config, replica_cpus))
                          for i in range(replicas)]
        self._pollers: list[concurrent.futures.Future] = []
        self._pool_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        try:
            self._call(self._start_all())
        except BaseException:
            self.shutdown()
            raise

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> "ReplicaSet":
        """Already started by the constructor (AsyncEngine's shape: `X(...).start()`)."""
        return self

    async def _start_all(self) -> None:
        infos = await asyncio.gather(*(r.actor.info.remote() for r in self._replicas),
                                     return_exceptions=True)
        for replica, info in zip(self._replicas, infos, strict=True):
            if isinstance(info, BaseException):
                raise ValueError(f"replica {replica.index} failed to start: {info}") from info
            replica.info, replica.alive = info, True
        self._pollers = [asyncio.ensure_future(self._poll(r)) for r in self._replicas]

    def _call(self, coroutine: Coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def shutdown(self, abort_running: bool = True, timeout: float | None = STOP_TIMEOUT_S) -> None:
        """Stop taking requests, abort the ones in flight, stop the actors."""
        if self._stopping:
            return
        self._accepting = False
        self._stopping = True
        live = [r for r in self._replicas if r.alive]
        try:
            ray.get([r.actor.shutdown.remote() for r in live], timeout=timeout)
        except RayError as error:
            logger.warning("stopping replicas: %s", error)
        for replica in self._replicas:
            ray.kill(replica.actor, no_restart=True)
            replica.alive = False
            self._fail_streams(replica, EngineClosed("the engine stopped"))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if self._owns_ray:
            ray.shutdown()

    @property
    def is_running(self) -> bool:
        return not self._stopping and any(r.alive for r in self._replicas)

    # ---- what the replicas serve -------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def served(self) -> ServedModel:
        """A started replica's: every replica runs the same config and model."""
        return next(r.info.served for r in self._replicas if r.info is not None)

    @property
    def is_reconfiguring(self) -> bool:
        return self._reconfiguring.locked()

    def counters(self) -> EngineCounters:
        """Totals over every replica, dead ones' last known included (monotonic)."""
        total = EngineCounters()
        for replica in self._replicas:
            total = add_counters(total, add_counters(replica.carried, replica.counters))
        return total

    def replica_statuses(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(r.index, r.alive, r.error, r.restarts, len(r.streams), r.kv_usage,
                              add_counters(r.carried, r.counters), self.index.num_blocks(r.index))
                for r in self._replicas]

    # ---- routing knobs -----------------------------------------------------------------
    @property
    def routing(self) -> str:
        return self.router.policy

    @property
    def routing_load_weight(self) -> float:
        return self.router.load_weight

    def set_routing(self, policy: str | None = None, load_weight: float | None = None) -> None:
        """Change the policy and / or the kv-aware load weight; later requests use them."""
        from kvscope.engine.replicas.router import check_policy

        if policy is not None:
            self.router.policy = check_policy(policy)
        if load_weight is not None:
            self.router.load_weight = check_load_weight(load_weight)

    def subscribe_decisions(self, maxsize: int = 1024):
        """Every RoutingDecision from now on."""
        return self._decision_feed.subscribe(maxsize)

    # ---- requests ----------------------------------------------------------------------
    def submit(self, prompt: str | list[int],
               params: SamplingParams | BeamSearchParams | None = None, *,
               request_id: str | None = None, source: str = "api", priority: int = 0,
               add_special_tokens: bool = True, cache_salt: str | None = None,
               ) -> RequestStream:
        """Route and queue a request; returns its stream at once (see AsyncEngine.submit).
        A request whose replica dies ends with ReplicaDown."""
        if not self._accepting:
            raise EngineClosed("the engine is shutting down; it takes no new requests")
        request_id = request_id or f"{source}-{next(self._request_ids)}"
        stream = RequestStream(request_id, source, lambda: self.abort(request_id))
        asyncio.run_coroutine_threadsafe(
            self._serve(stream, prompt, params or SamplingParams(), priority,
                        add_special_tokens, time.time(), cache_salt), self._loop)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort on the replica that owns the request; unknown ids are ignored."""
        for replica in self._replicas:
            if request_id in replica.streams:
                replica.actor.abort.remote(request_id)

    def _route(self, request_id: str, token_ids: list[int],
               cache_salt: str | None) -> RoutingDecision:
        live = [r for r in self._replicas if r.alive]
        if not live:
            raise EngineClosed("no replica is alive to serve the request")
        hashes = prompt_block_hashes(token_ids, self.config.block_size, cache_salt)
        max_num_seqs = self.config.max_num_seqs
        loads = [ReplicaLoad(r.index, len(r.streams), r.kv_usage, max_num_seqs) for r in live]
        decision = self.router.choose(request_id, hashes, loads)
        self.hits.open(request_id, decision.replica, decision.matched_blocks, hashes,
                       len(token_ids), self.config.block_size)
        self.recent_decisions.append(decision)
        self._decision_feed.publish(decision)
        return decision

    async def _serve(self, stream: RequestStream, prompt,
                     params: SamplingParams | BeamSearchParams, priority: int,
                     add_special_tokens: bool, arrival_time: float,
                     cache_salt: str | None) -> None:
        try:
            if isinstance(prompt, str):
                token_ids = self.tokenizer(prompt,
                                           add_special_tokens=add_special_tokens).input_ids
            else:
                token_ids = prompt
            replica = self._replicas[self._route(stream.request_id, token_ids,
                                                 cache_salt).replica]
        except Exception as error:  # noqa: BLE001 -- the stream's reader gets it
            stream.fail(error)
            return
        routed = _Routed(stream, prompt, token_ids, params, arrival_time)
        replica.streams[stream.request_id] = routed
        incarnation = replica.restarts
        try:
            outputs = replica.actor.generate.options(num_returns="streaming").remote(
                stream.request_id, prompt, params, priority, add_special_tokens, stream.source,
                cache_salt)
            accepted = False
            async for ref in outputs:
                item = await ref
                if isinstance(item, Exception):
                    if not accepted:  # refused: it never reached the replica's scheduler
                        self.hits.abandon(stream.request_id)
                    stream.fail(item)
                    return
                if not accepted:
                    accepted = True
                    stream.accept()
                    continue
                routed.last = item
                stream.push(item)
        except RayError as error:
            self._mark_down(replica, error, incarnation)
        finally:
            replica.streams.pop(stream.request_id, None)

    # ---- events and faults ---------------------------------------------------------------
    async def _poll(self, replica: _Replica) -> None:
        while not self._stopping:
            try:
                events = await replica.actor.next_events.remote(EVENT_POLL_S)
            except RayError as error:
                if self._stopping:
                    return
                self._mark_down(replica, error)
                if not self.restart_replicas or not await self._await_restart(replica):
                    return
                continue
            self.index.apply(replica.index, events.stored, events.evicted, events.event_seq)
            for step in events.steps:
                replica.last_step = step
                self._step_feed.publish(step)
            for record in events.requests:
                self._settle_hit(record)
                self._request_feed.publish(record)
            for record in events.pool:
                replica.pool_feed.publish(record)
            replica.counters = events.counters

    def _settle_hit(self, record: RequestRecord) -> None:
        output = record.output
        if output.metrics is not None and output.metrics.first_scheduled_time is not None:
            self.hits.settle(output.request_id, output.num_cached_tokens)
        else:  # aborted (or failed) before it was scheduled: no hit to compare
            self.hits.abandon(output.request_id)

    def _mark_down(self, replica: _Replica, error: BaseException,
                   incarnation: int | None = None) -> None:
        """`incarnation`: the replica's restart count when the failed call began; an error
        from an incarnation that has since been replaced says nothing about the new one
        (its streams were failed when the old one went down)."""
        if not replica.alive or incarnation not in (None, replica.restarts):
            return
        replica.alive = False
        replica.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        logger.error("replica %d is down (%s); %d request(s) fail", replica.index,
                     replica.error, len(replica.streams))
        self.index.drop(replica.index)
        self._fail_streams(replica, ReplicaDown(
            f"replica {replica.index} died while serving the request ({replica.error}); "
            "retry: the router sends new requests to the live replicas"))

    def _fail_streams(self, replica: _Replica, error: Exception) -> None:
        """Fail the replica's requests and record their ends (the session log, /metrics and
        the dashboard read them): the records the replica kept died with it."""
        routed, replica.streams = replica.streams, {}
        failed = replica.carried.requests_finished
        for request in routed.values():
            self.hits.abandon(request.stream.request_id)
            self._request_feed.publish(request.failed_record(replica.index, str(error)))
            failed["error"] = failed.get("error", 0) + 1
            request.stream.fail(error)

    async def _await_restart(self, replica: _Replica) -> bool:
        """Ray restarts the actor (a fresh engine: new weights load, empty pool); calls to
        it wait meanwhile. False when it will not come back (ActorDiedError: killed with
        no_restart, or out of restarts) or the set is stopping."""
        while not self._stopping:
            try:
                info = await replica.actor.info.remote()
                if self._knob_changes:  # Ray re-runs the constructor with the first config
                    await replica.actor.reconfigure.remote(False, self._knob_changes)
                    info = await replica.actor.info.remote()
            except ActorDiedError as error:
                logger.error("replica %d will not restart: %s", replica.index,
                             str(error).splitlines()[0][:300])
                return False
            except RayError:  # unavailable for a moment (its restart is under way)
                await asyncio.sleep(RESTART_POLL_S)
                continue
            replica.carried = add_counters(replica.carried, replica.counters)
            replica.counters, replica.last_step = EngineCounters(), None
            replica.info, replica.alive, replica.error = info, True, None
            replica.restarts += 1
            if replica.watched:
                replica.actor.watch_pool.remote()
            logger.info("replica %d restarted (restart %d)", replica.index, replica.restarts)
            return True
        return False

    # ---- readers -----------------------------------------------------------------------
    def _pick(self, replica: int | None) -> _Replica:
        if replica is None:
            return next((r for r in self._replicas if r.alive), self._replicas[0])
        if not 0 <= replica < len(self._replicas):
            raise ValueError(f"replica={replica} must be in [0, {len(self._replicas)})")
        return self._replicas[replica]

    async def _snapshot(self, replica: int | None) -> EngineSnapshot:
        return await self._pick(replica).actor.snapshot.remote()

    def snapshot_future(self, replica: int | None = None) -> concurrent.futures.Future:
        """A future of one replica's EngineSnapshot (the first live one by default)."""
        return asyncio.run_coroutine_threadsafe(self._snapshot(replica), self._loop)

    def snapshot(self, timeout: float | None = 10.0, replica: int | None = None) -> EngineSnapshot:
        return self.snapshot_future(replica).result(timeout)

    async def snapshot_async(self, replica: int | None = None) -> EngineSnapshot:
        return await asyncio.wrap_future(self.snapshot_future(replica))

    async def _slot_table(self, replica: int | None) -> SlotTable | None:
        return await self._pick(replica).actor.state_slot_table.remote()

    def state_slot_table(self, replica: int | None = None) -> SlotTable | None:
        """One replica's state slots (AsyncEngine.state_slot_table), asked of its actor."""
        return asyncio.run_coroutine_threadsafe(self._slot_table(replica),
                                                self._loop).result(10.0)

    def router_view(self, timeout: float | None = 10.0) -> RouterView:
        """The prefix index beside each live replica's prefix cache, and the routed
        requests' predicted hits beside their actual ones."""
        return self._call(self._router_view(), timeout)

    async def _router_view(self) -> RouterView:
        live = [r for r in self._replicas if r.alive]
        answers = await asyncio.gather(*(r.actor.cached_prefixes.remote() for r in live),
                                       return_exceptions=True)
        # A replica that died meanwhile is left out (its status says it is down).
        comparisons = tuple(compare_index(self.index, answer) for answer in answers
                            if not isinstance(answer, BaseException))
        totals = self.hits.totals
        return RouterView(self.config.block_size, comparisons,
                          tuple(dataclasses.replace(o) for o in self.hits.recent),
                          dataclasses.replace(totals,
                                              misses_by_reason=dict(totals.misses_by_reason)))

    def subscribe_steps(self, maxsize: int = 1024):
        """Every replica's StepRecords (each carries its `replica`)."""
        return self._step_feed.subscribe(maxsize)

    def subscribe_pool(self, maxsize: int = POOL_CHANNEL_RECORDS, replica: int | None = None):
        """One replica's pool records (the first live one by default) for a PoolMirror: a
        full snapshot, then one PoolDelta per step (see AsyncEngine.subscribe_pool)."""
        target = self._pick(replica)
        channel = target.pool_feed.subscribe(maxsize)
        self._pool_channels[channel] = target
        target.watched = True
        target.actor.watch_pool.remote()
        return channel

    def resync_pool(self, channel) -> None:
        """Send the channel's replica's watchers a fresh full snapshot (one missed a delta)."""
        self._pool_channels[channel].actor.watch_pool.remote()

    def subscribe_kv_events(self, listener) -> None:
        raise ValueError("kv_events_config: KV events are published by one engine; the "
                         "replicas' pools live in their own processes (use --replicas 1)")

    def subscribe_requests(self, maxsize: int = 10_000):
        """A RequestRecord (with its `replica`) for every request that ends."""
        return self._request_feed.subscribe(maxsize)

    # ---- reconfigure -------------------------------------------------------------------
    def reconfigure(self, abort_running: bool = False, timeout: float | None = None,
                    **knobs: Any) -> MemoryPlan:
        """Rebuild every live replica's KV cache with new knobs (see AsyncEngine)."""
        reload = sorted(set(knobs) & set(RELOAD_KNOBS))
        if reload:
            raise ValueError(f"{reload[0]}: changing {reload} reloads the weights; "
                             "restart the app instead")
        self._base_config.with_changes(**{**self._knob_changes, **knobs})  # fail fast
        with self._reconfiguring:
            return self._call(self._reconfigure(abort_running, knobs), timeout)

    async def _reconfigure(self, abort_running: bool, knobs: dict) -> MemoryPlan:
        live = [r for r in self._replicas if r.alive]
        plans = await asyncio.gather(*(r.actor.reconfigure.remote(abort_running, knobs)
                                       for r in live))
        self._knob_changes.update(knobs)
        infos = await asyncio.gather(*(r.actor.info.remote() for r in live))
        for replica, info in zip(live, infos, strict=True):
            replica.info = info
        return plans[0]
