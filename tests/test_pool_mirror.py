"""The reader's mirror of the pool, built from per-step deltas (and a sliced snapshot for a
late reader), equals a full snapshot after random workloads on a real engine."""

import json
import random
import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_history import PoolHistory, history_of
from kvscope.engine.telemetry.pool_messages import RecordReader, pool_messages
from kvscope.engine.telemetry.pool_mirror import PoolMirror, hash_key
from kvscope.engine.telemetry.pool_recorder import PoolRecorder
from kvscope.engine.telemetry.records import BlockInfo, EngineSnapshot, SequenceInfo

SLICE_BLOCKS = 5  # small, so a late reader's snapshot spans several steps
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23], []]


def pool_truth(core: EngineCore) -> EngineSnapshot:
    """The core's pool and queues read straight from its blocks and sequences: the oracle
    a mirror is checked against."""
    manager = core.kv_cache
    pool = manager.pool
    block_size = manager.block_size
    live = core.live_sequences()
    owners: dict[int, list[str]] = {}
    contents: dict[int, tuple[int, ...]] = {}
    for seq in live:
        for index, block_id in enumerate(seq.block_table):
            owners.setdefault(block_id, []).append(seq.seq_id)
            stored = seq.token_ids[index * block_size:min((index + 1) * block_size,
                                                          seq.num_computed_tokens)]
            contents.setdefault(block_id, tuple(stored))
    blocks = []
    for block in pool.blocks:
        block_hash = block.block_hash
        if block.ref_count > 1:
            state = "shared"
        elif block.ref_count == 1:
            state = "used"
        else:
            state = "cached" if block_hash is not None else "free"
        value, parent, tokens = block_hash or (None, None, contents.get(block.block_id, ()))
        blocks.append(BlockInfo(
            block.block_id, block.ref_count, state, value.hex() if value else None,
            parent.hex() if parent else None, tokens, tuple(owners.get(block.block_id, ()))))
    sequences = tuple(
        SequenceInfo(seq.seq_id, seq.request.request_id, seq.status.value,
                     tuple(seq.block_table), seq.num_tokens, seq.num_prompt_tokens,
                     seq.num_computed_tokens, seq.request.arrival_time)
        for seq in live)
    stats = manager.prefix_stats
    return EngineSnapshot(
        time=time.time(), step=core.step_index, config=core.config.to_dict(),
        block_size=block_size, num_blocks=pool.num_blocks, blocks=tuple(blocks),
        sequences=sequences, num_running=core.num_running, num_waiting=core.num_waiting,
        prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits,
        num_preemptions=core.scheduler.num_preemptions, num_evictions=pool.num_evictions)


def eviction_truth(core: EngineCore) -> tuple[list[int], list[int]]:
    """The cached-free blocks in the free queue's order (the next evicted first), and
    every block's prefix-cache hits, read from the core's pool."""
    pool = core.kv_cache.pool
    return ([block.block_id for block in pool.free_queue if block.block_hash is not None],
            [block.num_hits for block in pool.blocks])


def fingerprint(snapshot: EngineSnapshot) -> tuple:
    """What a frame of the scrubber must show: every block, every sequence, the counters."""
    return (tuple((b.block_id, b.ref_count, b.state, b.block_hash, b.parent_hash, b.token_ids,
                   tuple(sorted(b.owners))) for b in snapshot.blocks),
            tuple(sorted(snapshot.sequences, key=lambda seq: seq.seq_id)), snapshot.step,
            snapshot.num_running, snapshot.num_waiting, snapshot.num_preemptions,
            snapshot.num_evictions, snapshot.prefix_cache_hits)


def mirror_fingerprint(mirror: PoolMirror) -> tuple:
    return (fingerprint(mirror.snapshot()), mirror.eviction_order().tolist(),
            mirror.hit_counts.tolist())


def core_fingerprint(core: EngineCore) -> tuple:
    return fingerprint(pool_truth(core)), *eviction_truth(core)


def assert_mirror_matches(mirror: PoolMirror, core: EngineCore) -> None:
    snapshot = pool_truth(core)
    assert mirror.ready and mirror.num_blocks == snapshot.num_blocks
    assert mirror.block_size == snapshot.block_size
    for block in snapshot.blocks:
        mirrored = mirror.block_info(block.block_id)
        assert (mirrored.ref_count, mirrored.state, mirrored.block_hash, mirrored.parent_hash,
                mirrored.token_ids) == (block.ref_count, block.state, block.block_hash,
                                        block.parent_hash, block.token_ids), block.block_id
        assert sorted(mirrored.owners) == sorted(block.owners)
        if block.block_hash is not None:  # the prefix tree's numpy links
            assert mirror.hash_keys[block.block_id] == hash_key(bytes.fromhex(block.block_hash))
            assert mirror.has_parent[block.block_id] == (block.parent_hash is not None)
            if block.parent_hash is not None:
                assert mirror.parent_keys[block.block_id] == hash_key(
                    bytes.fromhex(block.parent_hash))
    assert {s.seq_id: s.info() for s in mirror.sequences} == {
        s.seq_id: s for s in snapshot.sequences}
    assert mirror.counts() == {state: snapshot.count(state)
                               for state in ("free", "cached", "used", "shared")}
    assert mirror.num_used_tokens == snapshot.num_used_tokens
    assert mirror.blocks_saved_by_sharing == snapshot.blocks_saved_by_sharing
    order, hits = eviction_truth(core)
    assert mirror.eviction_order().tolist() == order
    assert mirror.hit_counts.tolist() == hits
    counters = mirror.counters
    assert (counters.num_running, counters.num_waiting, counters.num_preemptions,
            counters.num_evictions, counters.prefix_cache_hits) == (
        snapshot.num_running, snapshot.num_waiting, snapshot.num_preemptions,
        snapshot.num_evictions, snapshot.prefix_cache_hits)


def test_mirror_built_from_deltas_equals_a_full_snapshot(make_engine) -> None:
    class MirrorMachine(RuleBasedStateMachine):
        """Requests sharing prefixes (prefix hits), n > 1 and beams (copy-on-write), a
        pool small enough to preempt, aborts, reconfigures between the two preemption
        modes, and a second reader that joins late through a sliced snapshot. The first
        reader's deltas also feed a PoolHistory (a short one, so old frames are dropped),
        and its records go through the session log's rows: every frame either keeps must
        be the pool as the core had it then."""

        def __init__(self) -> None:
            super().__init__()
            self.core = self._engine("recompute", 14)
            self.recorder = PoolRecorder(self.core).listen()
            self.mirror = PoolMirror()
            self.late: PoolMirror | None = None
            self.late_next = 0
            self.rng = random.Random(0)
            self.history = PoolHistory(max_frames=12)
            self.records: list = []  # every record the first reader applied, in order
            self.truths: list[tuple] = []  # the core's pool after each of its deltas
            self._start_reader(self.mirror)
            self._send_slices(self.mirror, everything=True)

        @staticmethod
        def _engine(preemption_mode: str, num_blocks: int) -> EngineCore:
            return make_engine("llama", block_size=2, max_model_len=24,
                               num_gpu_blocks_override=num_blocks, max_num_batched_tokens=12,
                               preemption_mode=preemption_mode, swap_space=0.001)

        def _publish(self, delta) -> None:
            for mirror in (self.mirror, self.late):
                if mirror is not None:
                    assert mirror.apply(delta)
            self.records.append(delta)
            self.history.add(self.mirror, delta)
            self.truths.append(core_fingerprint(self.core))

        def _publish_pending(self) -> None:
            """What AsyncEngine does after commands that changed the pool between steps."""
            if self.recorder.pending:
                self._publish(self.recorder.take_delta())

        def _start_reader(self, mirror: PoolMirror) -> None:
            self._publish_pending()
            base = self.recorder.take_base()
            assert mirror.apply(base)
            if mirror is self.mirror:
                self.records.append(base)

        def _send_slices(self, mirror: PoolMirror, everything: bool = False) -> None:
            start = 0 if mirror is self.mirror else self.late_next
            while start < self.core.kv_cache.pool.num_blocks:
                piece = self.recorder.take_slice(start, SLICE_BLOCKS)
                assert mirror.apply(piece)
                if mirror is self.mirror:
                    self.records.append(piece)
                start += SLICE_BLOCKS
                if not everything:
                    break
            if mirror is self.late:
                self.late_next = start

        @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(30, 40), max_size=9),
              n=st.integers(1, 3), beam=st.booleans(), max_tokens=st.integers(1, 12))
        def add(self, prefix, tail, n, beam, max_tokens):
            prompt = prefix + tail or [1]
            params = (BeamSearchParams(beam_width=n, max_tokens=max_tokens) if beam and n > 1
                      else SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True,
                                          temperature=1.0, seed=len(prompt)))
            try:
                self.core.add_request(prompt, params)
            except ValueError:
                pass  # does not fit this pool: refused, nothing changed
            self._publish_pending()

        @rule(count=st.integers(1, 6))
        def step(self, count):
            for _ in range(count):
                if not self.core.has_unfinished_requests():
                    return
                self.core.step()
                self._publish(self.recorder.take_delta())
                if self.late is not None:
                    self._send_slices(self.late)

        @rule(data=st.data())
        def abort(self, data):
            if self.core.requests:
                request_id = data.draw(st.sampled_from(sorted(self.core.requests)))
                self.core.abort_request(request_id)
                self._publish_pending()

        @rule(preemption_mode=st.sampled_from(["recompute", "swap"]),
              num_blocks=st.integers(12, 20))
        def reconfigure(self, preemption_mode, num_blocks):
            for request_id in list(self.core.requests):
                self.core.abort_request(request_id)
            self._publish_pending()
            step_index = self.core.step_index
            self.core = self._engine(preemption_mode, num_blocks)
            self.core.step_index = step_index
            self.recorder = PoolRecorder(self.core).listen()
            self._publish(self.recorder.take_delta())  # delta 0: readers start it empty
            if self.late is not None and not self.late.ready:
                self.late = None  # its snapshot was of the old pool; AsyncEngine restarts it

        @rule()
        def late_reader_joins(self):
            self.late, self.late_next = PoolMirror(), 0
            self._start_reader(self.late)

        @invariant()
        def mirrors_match_the_pool(self):
            assert_mirror_matches(self.mirror, self.core)
            if self.late is not None and self.late.ready:
                assert_mirror_matches(self.late, self.core)

        @invariant()
        def every_kept_frame_is_the_pool_then(self):
            if self.history.last is None:
                return
            for number in range(self.history.first, self.history.last + 1):
                assert mirror_fingerprint(self.history.mirror_at(number)) == \
                    self.truths[number], number

        def teardown(self):
            for request_id in list(self.core.requests):
                self.core.abort_request(request_id)
            # The same records as JSON (as /ws/events sends them and the session log keeps
            # them) give every frame back.
            reader = RecordReader()
            stored = history_of(record for message in pool_messages(self.records)
                                for record in reader.records_of(json.loads(json.dumps(message))))
            assert stored.last == self.history.last == (len(self.truths) - 1 if self.truths
                                                         else None)
            for number in range(len(self.truths)):
                assert mirror_fingerprint(stored.mirror_at(number)) == self.truths[number]

    run_state_machine_as_test(MirrorMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=list(HealthCheck)))



def test_a_block_evicted_and_cached_again_in_one_step_shows_its_hits_reset(make_engine) -> None:
    """Found by the state machine above: in one step a prefix-hit block is evicted (its hits
    forgotten) and filled again with the same content, so its hash reads unchanged; the
    reader must still see its hits go back to 0."""
    core = make_engine("llama", block_size=2, max_model_len=24, num_gpu_blocks_override=12,
                       max_num_batched_tokens=12, preemption_mode="swap", swap_space=0.001)
    recorder = PoolRecorder(core).listen()
    mirror = PoolMirror()
    assert mirror.apply(recorder.take_base())
    assert mirror.apply(recorder.take_slice(0, 100)) and mirror.ready
    prefix = PREFIXES[0]

    def add(prompt, max_tokens):
        core.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                temperature=1.0, seed=len(prompt)))

    add(prefix, 1)
    core.step()
    assert mirror.apply(recorder.take_delta())
    add([30] * 9, 2)
    add(prefix + [30] * 7, 1)
    for _ in range(3):
        core.step()
        assert mirror.apply(recorder.take_delta())
        assert_mirror_matches(mirror, core)

def test_a_missed_delta_asks_for_a_new_snapshot(make_engine) -> None:
    core = make_engine("llama", block_size=2, max_model_len=24, num_gpu_blocks_override=12)
    recorder = PoolRecorder(core).listen()
    mirror = PoolMirror()
    assert mirror.apply(recorder.take_base())
    assert mirror.apply(recorder.take_slice(0, 100)) and mirror.ready
    core.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    core.step()
    recorder.take_delta()  # lost
    core.step()
    assert not mirror.apply(recorder.take_delta())
