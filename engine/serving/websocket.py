"""WS /ws/events: step records and the pool's per-step deltas (each at most 10 messages
a second), a sliced pool snapshot when a client connects or falls behind, a ReplicaSet's
routing decisions, and a full EngineSnapshot on request ({"type": "snapshot"}). The
snapshot comes from the connection's own PoolMirror, kept from the deltas it sends, and is
built in a worker thread: it costs O(pool) there, never a copy of the pool on the engine
thread."""

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.streams import Channel
from kvscope.engine.replicas.router import RoutingDecision
from kvscope.engine.spec_decode.metrics import SPEC_DRAFT_FIELDS
from kvscope.engine.telemetry.experts import step_counts
from kvscope.engine.telemetry.pool_messages import pool_messages
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import CHUNK_FIELDS, EngineSnapshot, StepRecord

logger = logging.getLogger(__name__)
MIN_MESSAGE_INTERVAL_S = 0.1
# Records a client may fall behind by before the oldest are dropped (~a minute of steps
# at the 10 messages/s pace of a busy engine stepping ~50 times a second).
CLIENT_QUEUE_RECORDS = 4096


def step_message(records: list[StepRecord], num_dropped: int) -> str:
    return json.dumps({"type": "steps", "num_dropped": num_dropped,
                       "records": [_record_dict(record) for record in records]})


def _record_dict(record: StepRecord) -> dict:
    return {**dataclasses.asdict(record), "duration": record.duration,
            "chunks": [dict(zip(CHUNK_FIELDS, chunk)) for chunk in record.chunks],
            "spec_drafts": [dict(zip(SPEC_DRAFT_FIELDS, draft)) for draft in record.spec_drafts],
            "expert_tokens": step_counts(record).tolist()}


def routing_message(decisions: list[RoutingDecision], num_dropped: int) -> str:
    """Where the router sent each request: the chosen replica, the prompt's full blocks,
    and every candidate's matched prefix blocks, load and score (engine.replicas.router)."""
    return json.dumps({"type": "routing", "num_dropped": num_dropped, "decisions": [
        {**dataclasses.asdict(decision), "matched_blocks": decision.matched_blocks}
        for decision in decisions]})


def snapshot_message(snapshot: EngineSnapshot) -> str:
    derived = {"num_used_tokens": snapshot.num_used_tokens,
               "blocks_saved_by_sharing": snapshot.blocks_saved_by_sharing,
               "counts": {state: snapshot.count(state)
                          for state in ("free", "cached", "used", "shared")}}
    return json.dumps({"type": "snapshot", "snapshot": {**dataclasses.asdict(snapshot),
                                                        **derived}})


def events_router(engine: EngineView) -> APIRouter:
    router = APIRouter()

    @router.websocket("/ws/events")
    async def events(websocket: WebSocket) -> None:
        await websocket.accept()
        # The client's bounded queue: the engine drops its oldest records if it lags.
        records = engine.subscribe_steps(CLIENT_QUEUE_RECORDS)
        pool = engine.subscribe_pool(CLIENT_QUEUE_RECORDS)  # starts with a pool snapshot
        # The pool as this client was sent it; changed only under send_lock.
        mirror = PoolMirror()
        send_lock = asyncio.Lock()  # the tasks below share one socket
        # A single engine's decisions channel stays empty: nothing is sent for it.
        decisions = engine.subscribe_decisions(CLIENT_QUEUE_RECORDS)
        channels = [records, pool, decisions]
        tasks = [asyncio.create_task(_send_pool(websocket, engine, pool, mirror, send_lock)),
                 asyncio.create_task(_send_steps(websocket, records, send_lock)),
                 asyncio.create_task(_answer_requests(websocket, mirror, send_lock)),
                 asyncio.create_task(_forward(
                     websocket, decisions, send_lock,
                     lambda batch, dropped: [routing_message(batch, dropped)]))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except WebSocketDisconnect:
            pass
        finally:
            for channel in channels:
                channel.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return router


async def _forward(websocket: WebSocket, channel: Channel, send_lock: asyncio.Lock,
                   messages: Callable[[list, int], list[str]]) -> None:
    """Coalesce what arrived since the last send into `messages(batch, newly dropped)`,
    at most every 100 ms."""
    last_sent = 0.0
    dropped_reported = 0
    try:
        async for first in channel:
            await asyncio.sleep(max(0.0, last_sent + MIN_MESSAGE_INTERVAL_S - time.monotonic()))
            batch = [first, *channel.drain()]
            dropped = channel.num_dropped - dropped_reported
            dropped_reported += dropped
            async with send_lock:
                for message in messages(batch, dropped):
                    await websocket.send_text(message)
            last_sent = time.monotonic()
    except WebSocketDisconnect:
        return


def _send_steps(websocket: WebSocket, records: Channel, send_lock: asyncio.Lock):
    return _forward(websocket, records, send_lock,
                    lambda batch, dropped: [step_message(batch, dropped)])


def _send_pool(websocket: WebSocket, engine: EngineView, pool: Channel, mirror: PoolMirror,
               send_lock: asyncio.Lock):
    """The pool records, deltas coalesced; a client that fell behind (its queue dropped
    records) gets a new snapshot instead of a gap. The mirror follows what is sent."""
    def messages(batch: list, dropped: int) -> list[str]:
        if dropped or not all(mirror.apply(record) for record in batch):
            mirror.awaiting_base = True
            engine.resync_pool(pool)
        return [json.dumps(message) for message in pool_messages(batch)]

    return _forward(websocket, pool, send_lock, messages)


async def _mirror_snapshot(mirror: PoolMirror, send_lock: asyncio.Lock) -> str:
    """The snapshot message of the connection's mirror once it holds the whole pool (a
    few engine-loop turns after connecting or a resync); the pool's deltas wait
    meanwhile, so it is the pool as of one delta."""
    while True:
        async with send_lock:
            if mirror.ready:
                return await asyncio.to_thread(lambda: snapshot_message(mirror.snapshot()))
        await asyncio.sleep(MIN_MESSAGE_INTERVAL_S)


async def _answer_requests(websocket: WebSocket, mirror: PoolMirror,
                           send_lock: asyncio.Lock) -> None:
    """Clients ask for a fresh snapshot with {"type": "snapshot"}."""
    try:
        while True:
            text = await websocket.receive_text()
            try:
                wanted = json.loads(text).get("type")
            except (ValueError, AttributeError):
                wanted = None
            reply = (await _mirror_snapshot(mirror, send_lock) if wanted == "snapshot"
                     else json.dumps({"type": "error",
                                      "message": 'send {"type": "snapshot"} for a snapshot'}))
            async with send_lock:
                await websocket.send_text(reply)
    except WebSocketDisconnect:
        return
