"""SessionLog: the app's one writer of the SQLite session log, on its own thread."""

import atexit
import logging
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import insert, text, update

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.replicas.router import RoutingDecision
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_messages import pool_messages
from kvscope.engine.telemetry.records import StepRecord
from kvscope.storage import reader
from kvscope.storage.exports import export_session
from kvscope.storage.models import (
    ChatMessageRow,
    ConfigRow,
    PoolRecordRow,
    RequestRow,
    RoutingDecisionRow,
    SessionRow,
    StepRow,
)
from kvscope.storage.rows import request_row, routing_decision_row, step_row
from kvscope.storage.schema import open_database

if TYPE_CHECKING:  # beam search loads torch; the log only needs the params' to_dict()
    from kvscope.engine.orchestrator.beam_search import BeamSearchParams

logger = logging.getLogger(__name__)
# A commit at least this often bounds what a killed process loses to about one second.
COMMIT_INTERVAL_S = 0.5
MAX_BATCH = 2000
QUEUE_SIZE = 50_000
_STOP = object()
# A session still open when the next one starts was interrupted (its process died before
# close()): it ends at the last thing it logged.
CLOSE_INTERRUPTED = text(
    "UPDATE sessions SET ended_at = MAX(started_at,"
    " COALESCE((SELECT MAX(end_time) FROM steps WHERE session_id = sessions.id), 0),"
    " COALESCE((SELECT MAX(finished_time) FROM requests WHERE session_id = sessions.id), 0))"
    " WHERE ended_at IS NULL")


def _is_flush(item) -> bool:
    return item is not _STOP and item[0] == "flush"


class SessionLog:
    """Producers (the engine thread, handlers) only enqueue; a full queue drops the row
    and counts it, because the engine must never wait on the disk."""

    def __init__(self, db_path: str | Path, queue_size: int = QUEUE_SIZE):
        self.db_path = Path(db_path)
        self.engine = open_database(self.db_path)
        self.session_id: int | None = None
        self.started_at: float | None = None
        self._last_config: dict | None = None
        self.num_dropped = 0
        self.num_written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvscope-session-log",
                                        daemon=True)
        self._thread.start()
        # An interpreter exit without close() (Ctrl-C in a script) still flushes.
        atexit.register(self.close)

    # ---- producers ---------------------------------------------------------------------
    def start_session(self, config: dict, model: str) -> int:
        """Open a session row now (synchronously: the id tags every later row)."""
        started_at = self.started_at = time.time()
        with self.engine.begin() as connection:
            interrupted = connection.execute(CLOSE_INTERRUPTED).rowcount
            if interrupted:
                logger.warning("session log: %d earlier session(s) ended without closing "
                               "(the process was killed); closed at their last logged row",
                               interrupted)
            self.session_id = connection.execute(insert(SessionRow).values(
                model=model, config=config, started_at=started_at)).inserted_primary_key[0]
            connection.execute(insert(ConfigRow).values(
                session_id=self.session_id, applied_at=started_at, config=config))
        self._last_config = config
        return self.session_id

    def record_config(self, config: dict) -> None:
        """The engine was reconfigured: the session row keeps the latest config, and the
        history gets it with its time (once, however many callers report it)."""
        if config == self._last_config:
            return
        self._last_config = config
        self._put(("config", config))
        self._put((ConfigRow, {"session_id": self._current(), "applied_at": time.time(),
                               "config": config}))

    def record_step(self, record: StepRecord) -> None:
        self._put((StepRow, record))

    def record_pool(self, record, replica: int = 0) -> None:
        """One record of a replica's pool feed (engine.telemetry.records), in feed order."""
        self._put((PoolRecordRow, (replica, record)))

    def record_request(self, output: RequestOutput, source: str,
                       prompt_text: str | None = None, replica: int = 0,
                       params: "SamplingParams | BeamSearchParams | None" = None) -> None:
        """A finished request; prompt_text overrides output.prompt (e.g. the chat text);
        params, the sampling it ran with, let a replay run it again."""
        self._put((RequestRow, request_row(self._current(), output, source, prompt_text,
                                           replica, params, self.started_at)))

    def record_routing(self, decision: RoutingDecision) -> None:
        """Where the router sent a request (engine.replicas.ReplicaSet), with the scores."""
        self._put((RoutingDecisionRow, routing_decision_row(self._current(), decision)))

    def record_chat_message(self, conversation_id: str, role: str, content: str,
                            request_id: str | None = None) -> None:
        self._put((ChatMessageRow, {
            "session_id": self._current(), "conversation_id": conversation_id,
            "role": role, "content": content, "request_id": request_id,
            "created_at": time.time()}))

    def _current(self) -> int:
        if self.session_id is None:
            raise RuntimeError("SessionLog.start_session() must come before recording")
        return self.session_id

    def _put(self, item) -> None:
        self._current()
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1

    # ---- readers (the dashboard's sessions tab) ------------------------------------------
    def list_sessions(self) -> list[dict]:
        return reader.list_sessions(self.engine)

    def load_session(self, session_id: int) -> reader.StoredSession:
        return reader.load_session(self.engine, session_id)

    def count_pool_records(self, session_id: int) -> int:
        return reader.count_pool_records(self.engine, session_id)

    def pool_history(self, session_id: int, replica: int = 0) -> reader.PoolHistory:
        return reader.pool_history(self.engine, session_id, replica)

    def export(self, session_id: int, fmt: str, out_dir: str | Path) -> Path:
        return export_session(self.engine, session_id, fmt, out_dir)

    # ---- the writer thread -------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            deadline = time.monotonic() + COMMIT_INTERVAL_S
            # A flush is someone waiting (an answer held until its row is committed): the
            # batch is written at once rather than at the deadline.
            while len(batch) < MAX_BATCH and batch[-1] is not _STOP and not _is_flush(batch[-1]):
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(self._queue.get(timeout=timeout))
                except queue.Empty:
                    break
            stopping = batch[-1] is _STOP
            try:
                self._write([item for item in batch if item is not _STOP])
            except Exception:  # a full disk must not kill the thread that drains the queue
                logger.exception("session log: dropping a batch of %d rows", len(batch))
                self.num_dropped += len(batch)
            for kind, payload in batch[:-1] if stopping else batch:
                if kind == "flush":
                    payload.set()

    def _write(self, batch: list) -> None:
        rows: dict[type, list[dict]] = {RequestRow: [], StepRow: [], ChatMessageRow: [],
                                        ConfigRow: [], RoutingDecisionRow: [],
                                        PoolRecordRow: []}
        config = None
        for kind, payload in batch:
            if kind == "config":
                config = payload
            elif kind is StepRow:
                rows[StepRow].append(step_row(self.session_id, payload))
            elif kind is PoolRecordRow:  # as /ws/events sends it (one message a record)
                replica, record = payload
                (message,) = pool_messages([record])
                rows[PoolRecordRow].append({"session_id": self.session_id, "replica": replica,
                                            "kind": message["type"], "payload": message})
            elif kind in rows:
                rows[kind].append(payload)
        with self.engine.begin() as connection:
            for table, values in rows.items():
                if values:
                    connection.execute(insert(table), values)
            if config is not None:
                connection.execute(update(SessionRow).where(SessionRow.id == self.session_id)
                                   .values(config=config))
        self.num_written += sum(len(values) for values in rows.values())

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is committed; False if that timed out."""
        done = threading.Event()
        try:
            self._queue.put(("flush", done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self) -> None:
        """Flush every queued row, stamp the session's end and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)  # blocks only while full: shutdown may wait, the engine never
        self._thread.join()
        if self.session_id is not None:
            with self.engine.begin() as connection:
                connection.execute(update(SessionRow).where(SessionRow.id == self.session_id)
                                   .values(ended_at=time.time()))
        self.engine.dispose()

