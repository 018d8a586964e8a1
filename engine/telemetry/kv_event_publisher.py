"""vLLM's KV events over ZMQ (`--kv-events-config`): every block the prefix cache stores
or evicts, as msgpack KVEventBatches on a PUB socket, with a ROUTER socket that replays
missed batches by sequence number.

The engine thread only appends each BlockStored / BlockRemoved (a tuple of what the core
already made) to a deque; the publisher thread batches what arrived since its last turn,
encodes it and sends it, so the engine never waits on a socket. The messages are vLLM
0.32's: a multipart (topic, 8-byte big-endian sequence number, payload), the payload
kv_event_wire's; a replay request is (8-byte start sequence) on the ROUTER, answered with
(topic, seq, payload) for each buffered batch from there on and (b"", -1, b"") to end.
Preemptions and prefix misses ride along as kvscope's own events, in a fourth element of
the batch that vLLM's decoder skips (kv_event_wire.KVScopeEventBatch).
"""

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields

import msgspec
import zmq

from kvscope.engine.core import kv_events as core_events
from kvscope.engine.telemetry import kv_event_wire as wire

logger = logging.getLogger(__name__)
PUBLISHERS = ("null", "zmq")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the publisher thread waits for a replay request before it sends what arrived:
# the latency a batch may add, and at most this many wake-ups a second.
TURN_S = 0.02
# The core's events kvscope adds to a batch (kv_event_wire.KVScopeEventBatch): the ids they
# carry never change, so the publisher thread reads them safely.
REASONS = (core_events.SequencePreempted, core_events.PrefixMiss)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher={self.publisher!r}: choose one of "
                             f"{', '.join(PUBLISHERS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_events_config: not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("kv_events_config: give a JSON object of vLLM's fields")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv_events_config.{unknown[0]}: not a field; use "
                             f"{', '.join(sorted(known))}")
        return cls(**values)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    """Listens to an engine's KV events (`engine.subscribe_kv_events(publisher)`) and
    publishes them; `shutdown()` sends what is pending and closes the sockets.
    group_windows: the engine's KV cache groups' windows (MemoryPlan.group_windows), which
    give each event's group its kv_cache_spec fields."""

    def __init__(self, config: KVEventsConfig, group_windows: Sequence[int | None],
                 medium: str = wire.MEDIUM_GPU, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.group_windows = tuple(group_windows)
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self._pending: deque = deque(maxlen=config.max_queue_size)
        # The publisher thread's (see _publish_pending); bounded: without prefix caching no
        # batch of vLLM's ever comes.
        self._held_reasons: deque = deque(maxlen=config.max_queue_size)
        self._dropped_warned = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        _bind_or_connect(self._pub, config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events",
                                        daemon=True)
        self._thread.start()

    # ---- the engine thread ---------------------------------------------------------------
    def __call__(self, event: core_events.KVEvent | core_events.AllBlocksCleared) -> None:
        if isinstance(event, (core_events.BlockStored, core_events.BlockRemoved,
                              core_events.TierBlockStored, core_events.TierBlockRemoved,
                              core_events.AllBlocksCleared, *REASONS)):
            if len(self._pending) == self._pending.maxlen and not self._dropped_warned:
                self._dropped_warned = True
                logger.warning("KV events: more than max_queue_size=%d events waiting; the "
                               "oldest are dropped", self._pending.maxlen)
            self._pending.append(event)

    # ---- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is None:
                self._stop.wait(TURN_S)
            elif poller.poll(TURN_S * 1000):
                self._serve_replay()
            self._publish_pending()
        self._publish_pending(final=True)

    def _publish_pending(self, final: bool = False) -> None:
        events, reasons = [], self._held_reasons
        while self._pending:
            event = self._pending.popleft()
            (reasons if isinstance(event, REASONS) else events).append(event)
        # vLLM never sends a batch without events, so its consumers need not expect one:
        # kvscope's own wait for the next batch of vLLM's (the last batch excepted).
        if not events and not (final and reasons):
            return
        self._held_reasons = deque(maxlen=self.config.max_queue_size)
        vllm_events = wire.wire_events(events, self.medium, self.group_windows)
        if reasons:
            batch = wire.KVScopeEventBatch(
                ts=time.time(), events=vllm_events, data_parallel_rank=self.data_parallel_rank,
                kvscope_events=wire.wire_reasons(reasons))
        else:  # byte for byte vLLM's
            batch = wire.KVEventBatch(ts=time.time(), events=vllm_events,
                                      data_parallel_rank=self.data_parallel_rank)
        payload = self._encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames, not 3", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    @property
    def num_batches(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._next_seq

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _bind_or_connect(socket: zmq.Socket, endpoint: str) -> None:
    """vLLM's rule: bind a wildcard, ipc or inproc address, connect to any other."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def publish_kv_events(engine, config: KVEventsConfig) -> ZmqEventPublisher | None:
    """Start publishing `engine`'s KV events as `config` says (None: it says not to)."""
    if not config.publishes:
        return None
    device = engine.resolved_identity()["device"]
    # A reconfigure keeps the model, so the groups stay what they are now.
    publisher = ZmqEventPublisher(config, engine.memory_plan.group_windows,
                                  wire.MEDIUM_GPU if device.startswith("cuda")
                                  else wire.MEDIUM_CPU)
    try:
        engine.subscribe_kv_events(publisher)
    except ValueError:
        publisher.shutdown()
        raise
    return publisher
