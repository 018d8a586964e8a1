"""vLLM's KV events over ZMQ: a subscriber decoding with vLLM's msgspec shapes sees a
prompt's full blocks stored (hashes equal to the prefix cache's) and their eviction, and
the replay socket serves missed batches."""

import time

import msgspec
import pytest
import zmq
from conftest import free_port, wait_until

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.kv_event_publisher import KVEventsConfig, publish_kv_events
from kvscope.engine.telemetry.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TOPIC = "kv-events"


class Subscriber:
    """What a KV-aware router runs: SUB on the topic, msgspec decoding vLLM's batches."""

    def __init__(self, endpoint: str) -> None:
        self.since = time.time()  # a batch sent before the subscription is never received
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.seqs: list[int] = []

    def batch(self, timeout_s: float = 20.0) -> KVEventBatch:
        assert self.socket.poll(timeout_s * 1000), f"no batch in {timeout_s} s"
        topic, seq, payload = self.socket.recv_multipart()
        assert topic == TOPIC.encode()
        self.seqs.append(int.from_bytes(seq, "big"))
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.events
        assert self.since <= batch.ts <= time.time()  # when it was sent, in Unix seconds
        return batch

    def events_until(self, done) -> list:
        events = []
        while not done(events):
            events.extend(self.batch().events)
        return events


@pytest.fixture()
def served(tiny_model):
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        f'"tcp://*:{port}", "replay_endpoint": "tcp://*:{replay_port}", "topic": "{TOPIC}"}}')
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model("llama").path), dtype="float32", device="cpu",
        block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=64))
    publisher = publish_kv_events(engine, config)
    engine.start()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    yield engine, subscriber, f"tcp://127.0.0.1:{replay_port}"
    engine.shutdown()
    publisher.shutdown()
    subscriber.socket.close(linger=0)


def generate(engine: AsyncEngine, prompt: list[int], max_tokens: int = 1) -> None:
    stream = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in stream:
        pass


def stored_hashes(events) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_stored_blocks_carry_the_prefix_caches_hashes_and_eviction_removes_them(served):
    engine, subscriber, _ = served
    # Slow joiner: ZMQ drops what a PUB sends before the subscription arrives; prime it.
    for start in range(200, 240, BLOCK_SIZE):
        generate(engine, list(range(start, start + BLOCK_SIZE + 1)))
        if subscriber.socket.poll(500):
            break
    while subscriber.socket.poll(300):  # what the priming left in flight
        subscriber.batch()
    prompt = list(range(10, 10 + 3 * BLOCK_SIZE + 2))  # 3 full blocks and a partial one
    generate(engine, prompt)
    events = subscriber.events_until(lambda events: len(stored_hashes(events)) >= 3)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK_SIZE
    # Llama's one group of full attention:
    assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in stored} == {(0, "full_attention", None)}
    assert [t for e in stored for t in e.token_ids] == prompt[:3 * BLOCK_SIZE]
    # The pool's own hashes (a snapshot shows them in hex), block by block:
    cached = {block.token_ids: bytes.fromhex(block.block_hash)
              for block in engine.snapshot().blocks if block.block_hash is not None}
    expected = [cached[tuple(prompt[i:i + BLOCK_SIZE])]
                for i in range(0, 3 * BLOCK_SIZE, BLOCK_SIZE)]
    assert stored[0].block_hashes[1:] == expected[1:len(stored[0].block_hashes)]
    assert stored_hashes(events) == expected
    # Other prompts take every block: the cached ones are evicted, and said so.
    for start in range(100, 100 + NUM_BLOCKS * BLOCK_SIZE, 3 * BLOCK_SIZE):
        generate(engine, list(range(start, start + 3 * BLOCK_SIZE)))
    removed = subscriber.events_until(lambda events: set(expected) <= {
        h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes})
    assert {(e.medium, e.group_idx) for e in removed
            if not isinstance(e, AllBlocksCleared)} == {("CPU", 0)}
    assert subscriber.seqs == sorted(subscriber.seqs)


def test_replay_serves_missed_batches_and_a_reconfigure_clears_all(served):
    engine, subscriber, replay_endpoint = served
    generate(engine, list(range(10, 10 + 2 * BLOCK_SIZE)))
    engine.reconfigure(block_size=BLOCK_SIZE * 2)
    generate(engine, list(range(10, 10 + 2 * BLOCK_SIZE)))
    # DEALER, not REQ: one request is answered with several messages.
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def replayed() -> tuple[list[int], list]:
        seqs, events = [], []
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert replay.poll(10_000)
            _, topic, seq, payload = replay.recv_multipart()  # vLLM's frames
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                return seqs, events
            assert topic == TOPIC.encode()
            seqs.append(int.from_bytes(seq, "big"))
            events.extend(decoder.decode(payload).events)

    def published_all() -> bool:  # the publisher sends at its own pace
        return any(isinstance(e, BlockStored) and e.block_size == 2 * BLOCK_SIZE
                   for e in replayed()[1])

    wait_until(published_all, what="the second pool's first batch")
    seqs, events = replayed()
    replay.close(linger=0)
    assert seqs == list(range(len(seqs)))
    kinds = [type(e).__name__ for e in events]
    cleared = kinds.index("AllBlocksCleared")
    assert "BlockStored" in kinds[:cleared] and "BlockStored" in kinds[cleared:]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        KVEventsConfig(publisher="kafka")
    with pytest.raises(ValueError, match="kv_events_config.endpiont"):
        KVEventsConfig.from_json('{"endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="kv_events_config: not JSON"):
        KVEventsConfig.from_json("{")
    assert not KVEventsConfig(enable_kv_cache_events=True).publishes  # publisher "null"
