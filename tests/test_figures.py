"""Tests for ui figures: pool heatmap, block tables, prefix tree, timelines, comparison."""

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.telemetry import ScheduledChunk, StepRecord, take_snapshot
from ui.figures import (
    HEATMAP_COLUMNS,
    block_table_map,
    compare_memory,
    paged_vs_contiguous,
    pool_heatmap,
    prefix_tree,
)
from ui.palette import code_state
from ui.timeline import latency_stats, pool_series, request_timeline, timeline_spans

NUM_BLOCKS = 100
BLOCK_SIZE = 4
SYSTEM = "You are a helpful assistant. "


@pytest.fixture(scope="module")
def run(tiny_chat_model_path):
    """A finishes (its blocks become cached), then B reuses A's prefix with n=2 (shared)."""
    core = EngineCore(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu",
        block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=128,
        max_num_batched_tokens=8))
    records = []
    arrivals = {}

    def step_until(done) -> None:
        while not done():
            records.append(core.step().record)

    a = core.add_request(SYSTEM + "A?", SamplingParams(max_tokens=4, temperature=0))
    arrivals[a.request_id] = a.arrival_time
    step_until(lambda: not core.has_unfinished_requests())
    after_a = take_snapshot(core)
    b = core.add_request(SYSTEM + "B?", SamplingParams(max_tokens=8, temperature=0, n=2))
    arrivals[b.request_id] = b.arrival_time
    step_until(lambda: len(b.sequences) == 2)
    during_b = take_snapshot(core)
    step_until(lambda: not core.has_unfinished_requests())
    return after_a, during_b, records, arrivals


def heatmap_cells(figure) -> dict[int, float]:
    z = figure.data[0].z
    return {row * HEATMAP_COLUMNS + column: value for row, values in enumerate(z)
            for column, value in enumerate(values) if value is not None}


def test_heatmap_has_one_cell_per_block_coloured_by_state(run) -> None:
    after_a, during_b, _, _ = run
    for snapshot in (after_a, during_b):
        cells = heatmap_cells(pool_heatmap(snapshot))
        assert sorted(cells) == list(range(NUM_BLOCKS))
        assert {i: code_state(v) for i, v in cells.items()} == {
            block.block_id: block.state for block in snapshot.blocks}
    # A's finished prompt stays cached; B forked into two samples sharing its blocks.
    assert after_a.count("cached") > 0 and after_a.count("used") == 0
    first_block = during_b.sequences[0].block_table[0]
    assert during_b.blocks[first_block].state == "shared"
    assert heatmap_cells(pool_heatmap(during_b))[first_block] >= 3


def test_heatmap_hover_names_block_owners_and_text(run) -> None:
    _, during_b, _, _ = run
    figure = pool_heatmap(during_b, decode=lambda ids: "".join(map(chr, ids)))
    first_block = during_b.sequences[0].block_table[0]
    row, column = divmod(first_block, HEATMAP_COLUMNS)
    block_id, ref_count, state, owners, hash_prefix, _ = figure.data[0].customdata[row][column]
    assert (block_id, state) == (first_block, "shared")
    assert ref_count == 2 and set(owners.split(", ")) == {s.seq_id for s in during_b.sequences}
    assert hash_prefix == during_b.blocks[first_block].block_hash[:12]


def test_block_table_map_lines_up_shared_prefixes(run) -> None:
    _, during_b, _, _ = run
    figure = block_table_map(during_b)
    heatmap = figure.data[0]
    holders = [seq for seq in during_b.sequences if seq.block_table]
    assert len(heatmap.z) == len(holders) == 2
    for seq, texts in zip(holders, heatmap.text):
        assert [int(text.split("·")[0]) for text in texts] == list(seq.block_table)
    assert heatmap.text[0][0] == heatmap.text[1][0]  # the same physical block in both rows
    assert "/" in heatmap.text[0][-1]  # the last block shows its fill


def test_prefix_tree_follows_the_hash_chain(run) -> None:
    after_a, _, _, _ = run
    icicle = prefix_tree(after_a).data[0]
    hashed = {block.block_hash: block for block in after_a.blocks if block.block_hash}
    assert set(icicle.ids) == set(hashed) | {"root"}
    for node, parent in zip(icicle.ids, icicle.parents):
        if node != "root":
            expected = hashed[node].parent_hash
            assert parent == (expected if expected in hashed else "root")
    assert sum(parent == "root" for parent in icicle.parents) == 1  # one chain from A


def test_timeline_shows_chunked_prefill_decode_and_finish(run) -> None:
    _, _, records, arrivals = run
    spans = timeline_spans(records, arrivals)
    phases = {(span.row, span.phase) for span in spans}
    assert ("req-0", "prefill") in phases and ("req-0", "decode") in phases
    assert ("req-1#1", "decode") in phases  # the forked sample has its own row
    # A's 31-token prompt under an 8-token budget is prefilled in several chunks.
    assert sum(1 for s in spans if s.row == "req-0" and s.phase == "prefill") >= 4
    figure = request_timeline(records, arrivals)
    names = [trace["name"] for trace in figure["data"]]
    assert names == ["waiting", "prefill", "decode", "preempted", "finished"]
    assert len(figure["data"][-1]["x"]) == 3  # one finish mark per sequence


def test_preemption_becomes_a_span_until_the_sequence_resumes() -> None:
    def record(step: int, chunks, preempted=()) -> StepRecord:
        return StepRecord(step, step, step + 0.5, tuple(chunks), tuple(preempted), (), (), (),
                          1, 8, 1, 0, 7, 1, 0)

    spans = timeline_spans([
        record(0, [ScheduledChunk("r", "r", "prefill", 0, 4)]),
        record(1, [ScheduledChunk("r", "r", "decode", 4, 5)], preempted=["r"]),
        record(2, []),
        record(3, [ScheduledChunk("r", "r", "prefill", 0, 5)]),
    ])
    preempted = [s for s in spans if s.phase == "preempted"]
    assert [(s.start, s.end) for s in preempted] == [(1.5, 3)]


def test_latency_stats_and_series(run) -> None:
    _, _, records, arrivals = run
    stats = latency_stats(records, arrivals)
    assert len(stats.ttft) == 2 and all(t > 0 for t in stats.ttft)
    assert len(stats.itl) == 3 + 7 + 7  # decodes after each sequence's first token
    assert stats.output_tokens_per_s > 0
    figure = pool_series(records, token_usage=[(records[0].start_time, 0.5)])
    assert len(figure["data"][0]["y"]) == len(records)


def test_paged_memory_beats_a_contiguous_reservation(run) -> None:
    _, during_b, _, _ = run
    comparison = compare_memory(during_b)
    assert comparison.num_sequences == 2
    assert comparison.contiguous_reserved_tokens == 2 * 128
    assert comparison.paged_reserved_tokens < comparison.contiguous_reserved_tokens
    assert comparison.paged_useful > comparison.contiguous_useful
    assert "20.4–38.2%" in paged_vs_contiguous(during_b).layout.title.text
