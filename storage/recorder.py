"""record_sessions: the one recorder of an engine's feeds into the session log."""

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvscope.storage.session_log import QUEUE_SIZE, SessionLog

if TYPE_CHECKING:  # the engine's modules load torch; the log itself needs none of them
    from kvscope.engine.entrypoints.view import EngineView

POLL_S = 0.25
# How long an answer may wait for its row (a stalled disk then answers without it, and
# the row is written when the disk comes back).
SYNC_TIMEOUT_S = 5.0


class SessionRecorder:
    """The running recorder: `sync()` before acknowledging a finished request, `stop()` (or
    calling it) at the end."""

    def __init__(self, sync: Callable[[float], bool], stop: Callable[[], None]) -> None:
        self.sync = sync
        self.stop = stop

    def __call__(self) -> None:
        self.stop()


def record_sessions(engine: "EngineView", session_log: SessionLog,
                    poll_s: float = POLL_S) -> SessionRecorder:
    """Copy the engine's step records, finished requests, routing decisions (a single
    engine makes none), config changes and (for a single engine) the pool's records into
    the session log from a thread of its own; returns the recorder (stop it for a last
    drain). The one place a reconfigure is logged."""
    # Here, not at the top: the storage package loads without the engine (and torch).
    from kvscope.engine.entrypoints.view import resolved_config

    def record_request(finished) -> None:
        session_log.record_request(finished.output, finished.source, replica=finished.replica,
                                   params=finished.params)

    requests = engine.subscribe_requests()
    feeds = [(engine.subscribe_steps(maxsize=QUEUE_SIZE), session_log.record_step),
             (requests, record_request),
             (engine.subscribe_decisions(QUEUE_SIZE), session_log.record_routing)]
    # A ReplicaSet streams a replica's pool only while someone watches it: logging every
    # replica's would make them all stream all the time.
    pool = engine.subscribe_pool() if engine.num_replicas == 1 else None
    if pool is not None:
        feeds.append((pool, session_log.record_pool))
    stop = threading.Event()

    def drain() -> None:
        config = engine.config
        dropped = 0
        while True:
            stopping = stop.wait(poll_s)
            for channel, record in feeds:
                for item in channel.drain():
                    record(item)
            if pool is not None and pool.num_dropped != dropped:
                dropped = pool.num_dropped  # the log has a gap: a new snapshot follows it
                engine.resync_pool(pool)
            if engine.config is not config:
                config = engine.config
                session_log.record_config(resolved_config(engine))
            if stopping:
                return

    recorder = threading.Thread(target=drain, name="kvscope-session-recorder", daemon=True)
    recorder.start()

    def sync(timeout: float = SYNC_TIMEOUT_S) -> bool:
        """Every request finished so far is committed when this returns True (the engine
        publishes a request's record before its stream ends, so a request whose final
        output was seen is among them); False if the disk took longer than `timeout`."""
        for item in requests.drain():
            record_request(item)
        return session_log.flush(timeout)

    def stop_recording() -> None:
        stop.set()
        recorder.join()
        for channel, _ in feeds:
            channel.close()  # unsubscribe: the engine stops feeding them

    return SessionRecorder(sync, stop_recording)
