"""Thread-safe hand-offs between the engine thread and its readers: channels and request streams."""

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvscope.engine.outputs import RequestOutput


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped; it takes no new work."""


class RequestFailed(RuntimeError):
    """The engine step that ran this request raised; the request was aborted."""


class Channel:
    """A thread-safe FIFO that threads read with `get` / `for` and asyncio tasks with
    `aget` / `async for`; close it to end the readers (or, for a subscriber, to unsubscribe).

    With `maxsize`, a put into a full channel drops the oldest item (counted in
    `num_dropped`), so a slow reader never makes the writer wait.
    """

    def __init__(self, maxsize: int | None = None) -> None:
        self.maxsize = maxsize
        self.num_dropped = 0
        self._items: deque = deque()
        self._closed = False
        self._condition = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: Any) -> None:
        with self._condition:
            if self._closed:
                return
            if self.maxsize is not None and len(self._items) >= self.maxsize:
                self._items.popleft()
                self.num_dropped += 1
            self._items.append(item)
            self._wake()

    def close(self) -> None:
        """No more items; readers get what is left, then the end."""
        with self._condition:
            self._closed = True
            self._wake()

    def _wake(self) -> None:
        self._condition.notify_all()
        for loop, waiter in self._async_waiters:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # that reader's event loop is closed: nobody waits there
                pass
        self._async_waiters.clear()

    def get(self, timeout: float | None = None) -> Any:
        """The next item; raises StopIteration at the end, TimeoutError after `timeout`."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._items or self._closed, timeout):
                raise TimeoutError("no item within the timeout")
            if self._items:
                return self._items.popleft()
            raise StopIteration

    async def aget(self) -> Any:
        """The next item; raises StopAsyncIteration at the end."""
        while True:
            with self._condition:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise StopAsyncIteration
                loop = asyncio.get_running_loop()
                entry = (loop, loop.create_future())
                self._async_waiters.append(entry)
            try:
                await entry[1]
            except asyncio.CancelledError:
                with self._condition:
                    if entry in self._async_waiters:
                        self._async_waiters.remove(entry)
                raise

    def drain(self) -> list:
        """Every item available now, without waiting."""
        with self._condition:
            items = list(self._items)
            self._items.clear()
            return items

    def __iter__(self) -> Iterator:
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.aget()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():  # a cancelled reader leaves a cancelled future behind
        waiter.set_result(None)


def settle_future(future: concurrent.futures.Future, result: Any = None,
            error: BaseException | None = None) -> None:
    """Resolve a future whose waiter may have given up (an awaited wrap_future that is
    cancelled cancels it), without raising on the engine thread."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and the set


class Feed:
    """The subscribers to one kind of event; publishing never waits on a reader."""

    def __init__(self) -> None:
        self._subscribers: tuple[Channel, ...] = ()
        self._lock = threading.Lock()

    def subscribe(self, maxsize: int) -> Channel:
        channel = Channel(maxsize)
        with self._lock:  # a new tuple, so publish() iterates one nobody mutates
            self._subscribers = (*self._subscribers, channel)
        return channel

    def publish(self, item: Any) -> None:
        subscribers = self._subscribers
        for channel in subscribers:
            channel.put(item)
        if any(channel.closed for channel in subscribers):
            with self._lock:
                self._subscribers = tuple(c for c in self._subscribers if not c.closed)


class RequestStream:
    """The outputs of one request, each carrying per-sample `deltas` of new text.

    Iterate it synchronously (`for`) or asynchronously (`async for`); iteration ends after
    the finished output, raises ValueError if the engine refused the request and
    RequestFailed if a step failed it. Breaking out early does not abort: call `abort()`.

    The engine's side writes with `accept`, `push` and `fail` (from its own thread); the
    stream calls `on_abort` when a reader aborts it.
    """

    def __init__(self, request_id: str, source: str, on_abort: Callable[[], None]) -> None:
        self.request_id = request_id
        self.source = source
        self.finished = False
        self._on_abort = on_abort
        self._outputs = Channel()
        # Resolved on the engine thread once add_request accepted or refused the request.
        self._admission: concurrent.futures.Future[None] = concurrent.futures.Future()

    def wait_accepted(self, timeout: float | None = None) -> None:
        """Block until the engine queued the request; raises its ValueError if refused."""
        self._admission.result(timeout)

    async def accepted(self) -> None:
        """Wait until the engine queued the request; raises its ValueError if refused."""
        await asyncio.wrap_future(self._admission)

    def abort(self) -> None:
        """Stop the request (a no-op once it finished); the stream then ends."""
        if not self.finished:
            self._on_abort()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            try:
                item = self._outputs.get()
            except StopIteration:
                return
            yield self._unwrap(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        return self._unwrap(await self._outputs.aget())

    def _unwrap(self, item: RequestOutput | Exception) -> RequestOutput:
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    # ---- the engine's side ----------------------------------------------------------------
    def accept(self) -> None:
        """The engine queued the request."""
        settle_future(self._admission)

    def fail(self, error: Exception) -> None:
        """The engine refused the request, or a step failed it: readers get `error`."""
        settle_future(self._admission, error=error)
        self._outputs.put(error)
        self._outputs.close()

    def push(self, output: RequestOutput) -> None:
        """A new output; the finished one ends the stream."""
        self._outputs.put(output)
        if output.finished:
            self._outputs.close()
