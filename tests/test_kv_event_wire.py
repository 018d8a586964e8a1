"""kvscope's KV events against bytes vLLM's own classes made (tests/fixtures/kv_events_vllm.py,
run in vLLM's venv): the same pool events must encode to exactly vLLM's bytes, through the
publisher's socket too, and vLLM's bytes must decode with kvscope's structs. A field
reordered, renamed, dropped or added, a tag renamed, an array where vLLM has a map: the
bytes differ."""

import base64
import json
import sys
from pathlib import Path

import msgspec
import pytest
import zmq
from fixtures.msgspec_shape import readable, struct_shape

from kvscope.engine.core import kv_events as core
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry import kv_event_wire as wire
from kvscope.engine.telemetry.kv_event_publisher import (
    TURN_S,
    KVEventsConfig,
    ZmqEventPublisher,
)

FIXTURES = sorted(Path(__file__).parent.joinpath("fixtures").glob("kv_events_vllm-*.json"))


@pytest.fixture(params=FIXTURES, ids=[path.stem for path in FIXTURES])
def fixture(request) -> dict:
    return json.loads(request.param.read_text())


def core_events(fixture: dict) -> list:
    """The pool's events the fixture says kvscope's core emits."""
    events = []
    for event in fixture["core_events"]:
        if event["event"] == "AllBlocksCleared":
            events.append(core.AllBlocksCleared())
            continue
        parent = event["parent"] and bytes.fromhex(event["parent"])
        block_hash = (bytes.fromhex(event["hash"]), parent,
                      tuple(fixture["token_ids"][str(event["block"])]))
        kind = core.BlockStored if event["event"] == "BlockStored" else core.BlockRemoved
        events.append(kind(event["block_id"], block_hash, event["group"]))
    return events


def vllm_payload(fixture: dict) -> bytes:
    return base64.b64decode(fixture["payload_base64"])


def test_the_fixture_names_the_vllm_that_made_it(fixture):
    assert fixture["made_by"] == "tests/fixtures/kv_events_vllm.py"
    assert FIXTURES[0].with_name(f"kv_events_vllm-{fixture['vllm']}.json") in FIXTURES


def test_kvscopes_structs_are_vllms(fixture):
    """Field by field, defaults too: a None field is left out of the bytes."""
    shapes = {name: struct_shape(getattr(wire, name)) for name in fixture["structs"]}
    assert shapes == fixture["structs"]


def test_kvscopes_events_encode_to_vllms_bytes(fixture):
    batch = wire.KVEventBatch(
        ts=fixture["ts"], data_parallel_rank=fixture["data_parallel_rank"],
        events=wire.wire_events(core_events(fixture), fixture["medium"],
                                fixture["group_windows"]))
    assert msgspec.msgpack.encode(batch) == vllm_payload(fixture)


def test_vllms_bytes_decode_with_kvscopes_structs(fixture):
    batch = msgspec.msgpack.decode(vllm_payload(fixture), type=wire.KVEventBatch)
    assert [type(event).__name__ for event in batch.events] == [
        event["type"] for event in fixture["decoded"][1]]
    assert readable(msgspec.to_builtins(batch, builtin_types=(bytes,))) == fixture["decoded"]
    assert msgspec.msgpack.encode(batch) == vllm_payload(fixture)



def test_the_publisher_sends_vllms_bytes(fixture):
    """Through the socket: the same batch, but for the publisher's own clock."""
    endpoint = "inproc://kv-event-wire"
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                       topic="kv"),
        fixture["group_windows"], fixture["medium"], fixture["data_parallel_rank"])
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.connect(endpoint)  # inproc: connected before the first send, nothing is lost
    interval = sys.getswitchinterval()
    try:
        # One batch: the publisher thread cannot take the GIL (and what is pending) until
        # every event is in.
        sys.setswitchinterval(60.0)
        for event in core_events(fixture):
            publisher(event)
        sys.setswitchinterval(interval)
        publisher.shutdown()  # sends what is pending
        assert subscriber.poll(5_000)
        topic, seq, payload = subscriber.recv_multipart()
    finally:
        sys.setswitchinterval(interval)
        subscriber.close(linger=0)
    assert (topic, seq) == (b"kv", (0).to_bytes(8, "big"))
    ts, *rest = msgspec.msgpack.decode(payload)  # untyped: maps keep their order
    assert isinstance(ts, float)
    assert msgspec.msgpack.encode([fixture["ts"], *rest]) == vllm_payload(fixture)


def test_a_hybrid_pools_events_name_their_group():
    """What feeds group_idx: a full-attention group 0 and a sliding group 1 (window 4)
    cache a prompt's blocks and evict them, each event naming the group that held it."""
    events: list = []
    manager = KVCacheManager(num_blocks=6, block_size=2, group_windows=(None, 4),
                             emit=events.append)
    seq = Sequence("a", Request("a", None, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)),
                   0, [1, 2, 3, 4, 5], 5)
    assert manager.allocate_slots(seq, 5) == []
    seq.num_computed_tokens = 5
    manager.cache_full_blocks(seq)
    stored = [event for event in events if isinstance(event, core.BlockStored)]
    table = seq.block_table  # interleaved: entry 2 * position + group
    assert [(event.block_id, event.group) for event in stored] == [
        (table[0], 0), (table[2], 0), (table[1], 1), (table[3], 1)]
    manager.free(seq)
    events.clear()
    other = Sequence("b", Request("b", None, [9] * 11, SamplingParams(max_tokens=1)),
                     0, [9] * 11, 11)
    assert manager.allocate_slots(other, 6) == []  # six blocks: every cached one evicted
    removed = {event.block_id: event.group for event in events
               if isinstance(event, core.BlockRemoved)}
    assert removed == {table[0]: 0, table[2]: 0, table[1]: 1, table[3]: 1}


def preemption_and_miss() -> list:
    """A core preemption (b for a) and a prefix miss (a's), as the scheduler emits them."""
    a, b = (Sequence(name, Request(name, None, [1, 2, 3], SamplingParams(max_tokens=1)),
                     0, [1, 2, 3], 3) for name in ("a", "b"))
    return [core.SequencePreempted(b, core.PreemptionReason.PRIORITY, a, 2, 7),
            core.PrefixMiss(a, core.MissReason.EVICTED, 8, "c", 4)]


KVSCOPE_EVENTS = [wire.SequencePreempted("b", "b", "priority", "a", 2, 7),
                  wire.PrefixMiss("a", "a", "evicted", 8, "c", 4)]


def test_kvscopes_own_events_ride_past_what_vllms_decoder_reads(fixture):
    """vLLM's batch is an array-like struct: msgspec skips elements past its fields, so
    vLLM's decoder reads the batch as vLLM's own (tests/fixtures' struct shapes are
    vLLM's), and kvscope's decoder reads the reasons too."""
    batch = wire.KVScopeEventBatch(
        ts=fixture["ts"], data_parallel_rank=fixture["data_parallel_rank"],
        events=wire.wire_events(core_events(fixture), fixture["medium"],
                                fixture["group_windows"]),
        kvscope_events=wire.wire_reasons(preemption_and_miss()))
    payload = msgspec.msgpack.encode(batch)
    as_vllm = msgspec.msgpack.decode(payload, type=wire.KVEventBatch)
    assert msgspec.msgpack.encode(as_vllm) == vllm_payload(fixture)
    assert msgspec.msgpack.decode(payload, type=wire.KVScopeEventBatch).kvscope_events == \
        KVSCOPE_EVENTS


def batches_sent(subscriber, first_within_ms: int) -> list:
    """The batches that reach the subscriber, decoded as kvscope's."""
    batches, timeout_ms = [], first_within_ms
    while subscriber.poll(timeout_ms):
        batches.append(msgspec.msgpack.decode(subscriber.recv_multipart()[2],
                                              type=wire.KVScopeEventBatch))
        timeout_ms = 200
    return batches


def test_the_publisher_holds_kvscopes_events_for_a_batch_of_vllms(fixture):
    """A preemption alone sends nothing (vLLM never sends a batch without events); it goes
    with the next stored or removed blocks, and a batch of vLLM's alone is vLLM's bytes
    still (test_the_publisher_sends_vllms_bytes). At shutdown what is held goes alone."""
    endpoint = "inproc://kv-event-reasons"
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
        fixture["group_windows"], fixture["medium"], fixture["data_parallel_rank"])
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    try:
        for event in preemption_and_miss():
            publisher(event)
        assert batches_sent(subscriber, 10 * 1000 * TURN_S) == []
        for event in core_events(fixture):
            publisher(event)
        (batch,) = batches_sent(subscriber, 5_000)
        assert batch.events and batch.kvscope_events == KVSCOPE_EVENTS
        publisher(preemption_and_miss()[0])
        publisher.shutdown()
        (last,) = batches_sent(subscriber, 5_000)
        assert last.events == [] and last.kvscope_events == KVSCOPE_EVENTS[:1]
    finally:
        publisher.shutdown()
        subscriber.close(linger=0)
