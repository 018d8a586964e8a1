"""WS /ws/events: step records (at most 10 messages a second) and block-pool snapshots."""

import asyncio
import dataclasses
import json
import logging
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from engine.async_engine import AsyncEngine
from engine.streams import Channel
from engine.telemetry import EngineSnapshot, StepRecord

logger = logging.getLogger(__name__)
MIN_MESSAGE_INTERVAL_S = 0.1
# Records a client may fall behind by before the oldest are dropped (~a minute of steps
# at the 10 messages/s pace of a busy engine stepping ~50 times a second).
CLIENT_QUEUE_RECORDS = 4096


def step_message(records: list[StepRecord], num_dropped: int) -> str:
    return json.dumps({"type": "steps", "num_dropped": num_dropped,
                       "records": [_record_dict(record) for record in records]})


def _record_dict(record: StepRecord) -> dict:
    return {**dataclasses.asdict(record), "duration": record.duration}


def snapshot_message(snapshot: EngineSnapshot) -> str:
    derived = {"num_used_tokens": snapshot.num_used_tokens,
               "blocks_saved_by_sharing": snapshot.blocks_saved_by_sharing,
               "counts": {state: snapshot.count(state)
                          for state in ("free", "cached", "used", "shared")}}
    return json.dumps({"type": "snapshot", "snapshot": {**dataclasses.asdict(snapshot),
                                                        **derived}})


def events_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.websocket("/ws/events")
    async def events(websocket: WebSocket) -> None:
        await websocket.accept()
        # The client's bounded queue: the engine drops its oldest records if it lags.
        records = engine.subscribe_steps(CLIENT_QUEUE_RECORDS)
        send_lock = asyncio.Lock()  # the two tasks below share one socket
        tasks = [asyncio.create_task(_send_steps(websocket, records, send_lock)),
                 asyncio.create_task(_answer_requests(websocket, engine, send_lock))]
        try:
            async with send_lock:
                await websocket.send_text(snapshot_message(await engine.snapshot_async()))
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except WebSocketDisconnect:
            pass
        finally:
            records.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return router


async def _send_steps(websocket: WebSocket, records: Channel, send_lock: asyncio.Lock) -> None:
    """Coalesce what arrived since the last message into one, at most every 100 ms."""
    last_sent = 0.0
    dropped_reported = 0
    try:
        async for first in records:
            await asyncio.sleep(max(0.0, last_sent + MIN_MESSAGE_INTERVAL_S - time.monotonic()))
            batch = [first, *records.drain()]
            dropped = records.num_dropped - dropped_reported
            dropped_reported += dropped
            async with send_lock:
                await websocket.send_text(step_message(batch, dropped))
            last_sent = time.monotonic()
    except WebSocketDisconnect:
        return


async def _answer_requests(websocket: WebSocket, engine: AsyncEngine,
                           send_lock: asyncio.Lock) -> None:
    """Clients ask for a fresh snapshot with {"type": "snapshot"}."""
    try:
        while True:
            text = await websocket.receive_text()
            try:
                wanted = json.loads(text).get("type")
            except (ValueError, AttributeError):
                wanted = None
            reply = (snapshot_message(await engine.snapshot_async()) if wanted == "snapshot"
                     else json.dumps({"type": "error",
                                      "message": 'send {"type": "snapshot"} for a snapshot'}))
            async with send_lock:
                await websocket.send_text(reply)
    except WebSocketDisconnect:
        return
