"""The telemetry a reader keeps for long (the step history, the pool mirror) gives Python's
cyclic garbage collector nothing to walk per chunk or per held block, and every reader of
the compact form (storage, /ws/events, timelines) reads what the scheduler planned."""

import gc
import json

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving.websocket import step_message
from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.pool_recorder import PoolRecorder
from kvscope.engine.telemetry.records import CHUNK_FIELDS, SequenceChange
from kvscope.storage.rows import step_record, step_row
from kvscope.ui.timeline import timeline_spans


def tracked_objects_reachable(root) -> int:
    """Objects the collector tracks among those reachable from `root` (its own included)."""
    seen, stack, tracked = {id(root)}, [root], 0
    while stack:
        obj = stack.pop()
        tracked += gc.is_tracked(obj)
        for referent in gc.get_referents(obj):
            if id(referent) not in seen and not isinstance(referent, type):
                seen.add(id(referent))
                stack.append(referent)
    return tracked


def settle() -> None:
    """A collection untracks a tuple whose items it has already found untracked; it walks
    objects in an order it reshuffles as it goes, so nesting settles within a few."""
    for _ in range(3):
        gc.collect()


def run_recording_plans(engine) -> tuple[list, list]:
    """Step until done: (step records, the chunks each step's plan scheduled)."""
    planned = []
    schedule = engine.scheduler.schedule

    def schedule_and_note():
        plan = schedule()
        planned.append([(item.seq.request.request_id, item.seq.seq_id, item.kind.value,
                         item.start, item.end) for item in plan.scheduled])
        return plan

    engine.scheduler.schedule = schedule_and_note
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step().record)
    return records, planned


def test_step_history_is_what_was_scheduled_and_untracked_by_the_collector(make_engine):
    engine = make_engine("llama", block_size=2, num_gpu_blocks_override=64, max_model_len=32,
                         max_num_batched_tokens=8)
    for index, n in enumerate((1, 2)):
        engine.add_request([5, 6, 7, 8, 9, 10 + index], SamplingParams(
            max_tokens=4, temperature=0, n=n, ignore_eos=True))
    records, planned = run_recording_plans(engine)

    assert [list(record.chunks) for record in records] == planned
    assert any(len(chunks) > 1 for chunks in planned)  # mixed and parallel steps
    settle()
    for record in records:  # chunks are plain tuples of str and int: untracked
        assert not gc.is_tracked(record.chunks)
        assert all(type(kind) is str for _, _, kind, _, _ in record.chunks)  # not an enum

    # The session log's row round-trips to the same record.
    assert [step_record(step_row(1, record)) for record in records] == records
    # /ws/events names each chunk's fields.
    message = json.loads(step_message(records, 0))
    assert [[tuple(chunk[name] for name in CHUNK_FIELDS) for chunk in record["chunks"]]
            for record in message["records"]] == planned
    # The timeline's prefill spans are the planned prefill chunks, per sequence.
    spans = timeline_spans(records)
    assert sorted((s.row, s.label.split(": ")[1]) for s in spans if s.phase == "prefill") == \
        sorted((seq_id, f"tokens [{start}, {end})") for chunks in planned
               for _, seq_id, kind, start, end in chunks if kind == "prefill")


def test_a_mirror_holds_no_python_object_per_held_block(make_engine):
    """Who holds a block comes from an index built on demand, and the sequences' tables
    and tokens are arrays: a long sequence adds no tracked objects to the mirror."""
    counts = {}
    for prompt_length in (8, 200):
        engine = make_engine("llama", block_size=1, num_gpu_blocks_override=256,
                             max_model_len=256, max_num_batched_tokens=256)
        engine.add_request(list(range(3, 3 + prompt_length)), SamplingParams(max_tokens=3))
        recorder = PoolRecorder(engine).listen()
        mirror = PoolMirror.of(recorder.take_full())
        deltas = []
        for _ in range(2):
            engine.step()
            deltas.append(recorder.take_delta())
        for delta in deltas:
            assert mirror.apply(delta)
        seq = mirror.sequences[0]
        assert len(seq.block_table) >= prompt_length
        last = seq.block_table[-1]
        assert mirror.block_info(last).owners == (seq.seq_id,)
        assert mirror.holders(last) == [(seq, len(seq.block_table) - 1)]
        settle()
        counts[prompt_length] = tracked_objects_reachable(mirror)
        # A reader's queue of deltas: their sequence changes are plain tuples, untracked.
        assert all(not gc.is_tracked(delta.sequences) for delta in deltas)
        assert deltas[-1].sequences and all(
            SequenceChange._make(change).seq_id == seq.seq_id for change in deltas[-1].sequences)
    assert counts[200] == counts[8]
