"""The OS thread that steps a served engine, named so that `top -H` and the benches can
tell it (and the OpenMP workers it starts, which inherit the name) from the server's.

Where the model is loaded matters for OpenMP: libgomp keeps a worker team for every
thread that has run a parallel region, and with more OpenMP threads than cores it stops
spin-waiting between regions. Loaded on the main thread and stepped here, the engine has
two teams, so torch's OpenMP workers sleep between regions. Before the kernels had their own
work pool that halved a served stream; with the pool, workers that sleep leave the second
core to the pool's helper, and on the shared 2-core machine a core built here (one team,
spinning workers) decoded slower, so the model is still loaded on the caller's thread
(docs/performance-history.md, 'Figures the code's comments quoted').
"""

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EngineThread:
    """A daemon thread that runs the calls given to it one after another, in order."""

    def __init__(self, name: str = "kvscope-engine") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run `function(*args)` on the thread after the calls before it; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, function, args))
        return future

    def finish(self) -> None:
        """No more calls: the thread ends after the ones already given."""
        self._calls.put(None)

    @property
    def native_id(self) -> int | None:
        """The OS thread id (for /proc/self/task/<id>, per-thread CPU time and priority)."""
        return self._thread.native_id

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        _name_os_thread(self._thread.name)
        while (item := self._calls.get()) is not None:
            future, function, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 -- the caller's future carries it
                future.set_exception(error)


def _name_os_thread(name: str) -> None:
    """Give the OS thread the Python thread's name (Linux keeps 15 bytes). Threads it
    starts inherit it, so `top -H` and the overhead bench tell the engine and its OpenMP
    workers from the server's threads."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:  # not Linux, or /proc is not mounted: names are only a convenience
        pass
