"""record_sessions: the one recorder of an engine's feeds into the session log."""

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvscope.storage.session_log import QUEUE_SIZE, SessionLog

if TYPE_CHECKING:  # the engine's modules load torch; the log itself needs none of them
    from kvscope.engine.view import EngineView

POLL_S = 0.25


def record_sessions(engine: "EngineView", session_log: SessionLog,
                    poll_s: float = POLL_S) -> Callable[[], None]:
    """Copy the engine's step records, finished requests, routing decisions (a single
    engine makes none), config changes and (for a single engine) the pool's records into
    the session log from a thread of its own; returns the function that stops it, after a
    last drain. The one place a reconfigure is logged."""
    # Here, not at the top: the storage package loads without the engine (and torch).
    from kvscope.engine.view import resolved_config

    feeds = [(engine.subscribe_steps(maxsize=QUEUE_SIZE), session_log.record_step),
             (engine.subscribe_requests(), lambda finished: session_log.record_request(
                 finished.output, finished.source, replica=finished.replica,
                 params=finished.params)),
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

    def stop_recording() -> None:
        stop.set()
        recorder.join()
        for channel, _ in feeds:
            channel.close()  # unsubscribe: the engine stops feeding them

    return stop_recording
