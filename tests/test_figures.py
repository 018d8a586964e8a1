"""Tests for ui figures: pool heatmap, block tables, prefix tree, timelines, comparison."""

import json
import re
from collections import Counter

import numpy as np
import pytest
from conftest import heatmap_state_codes, plotly_array

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.pool_mirror import STATES, PoolMirror
from kvscope.engine.telemetry.pool_recorder import mirror_of
from kvscope.engine.telemetry.records import (
    EngineSnapshot,
    PoolBase,
    PoolCounters,
    PoolSlice,
    SequenceChange,
    StepRecord,
)
from kvscope.ui.figures import (
    HEATMAP_COLUMNS,
    MAX_CELLS,
    MAX_TABLE_COLUMNS,
    MAX_TABLE_ROWS,
    TableView,
    block_table_map,
    cell_counts,
    compare_memory,
    paged_vs_contiguous,
    pool_heatmap,
    prefix_tree,
    table_columns,
)
from kvscope.ui.palette import hover_text
from kvscope.ui.radix_tree import MAX_TREE_NODES
from kvscope.ui.timeline import (
    MAX_TIMELINE_ROWS,
    latency_stats,
    pool_series,
    request_timeline,
    timeline_spans,
)

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
    after_a = mirror_and_snapshot(core)
    b = core.add_request(SYSTEM + "B?", SamplingParams(max_tokens=8, temperature=0, n=2))
    arrivals[b.request_id] = b.arrival_time
    step_until(lambda: len(b.sequences) == 2)
    during_b = mirror_and_snapshot(core)
    step_until(lambda: not core.has_unfinished_requests())
    return after_a, during_b, records, arrivals


def mirror_and_snapshot(core: EngineCore) -> tuple[PoolMirror, EngineSnapshot]:
    """A reader's mirror of the core's pool, and the full snapshot made from it."""
    mirror = mirror_of(core)
    assert mirror.ready
    return mirror, mirror.snapshot()


def heatmap_cells(figure) -> dict[int, int]:
    """Block id -> state code of an exact (one cell per block) heatmap."""
    codes = heatmap_state_codes(figure)
    first_row = int(figure["data"][0]["y"][0])
    return {first_row + row * HEATMAP_COLUMNS + column: int(code)
            for (row, column), code in np.ndenumerate(codes) if not np.isnan(code)}


def test_heatmap_has_one_cell_per_block_coloured_by_state(run) -> None:
    after_a, during_b, _, _ = run
    for mirror, snapshot in (after_a, during_b):
        cells = heatmap_cells(pool_heatmap(mirror))
        assert sorted(cells) == list(range(NUM_BLOCKS))
        assert {i: STATES[code] for i, code in cells.items()} == {
            block.block_id: block.state for block in snapshot.blocks}
    # A's finished prompt stays cached; B forked into two samples sharing its blocks.
    mirror, snapshot = after_a
    assert snapshot.count("cached") > 0 and snapshot.count("used") == 0
    mirror, snapshot = during_b
    first_block = snapshot.sequences[0].block_table[0]
    assert snapshot.blocks[first_block].state == "shared"
    figure = pool_heatmap(mirror)
    assert heatmap_cells(figure)[first_block] == 3
    row, column = divmod(first_block, HEATMAP_COLUMNS)
    assert plotly_array(figure["data"][1]["z"])[row, column] == 2  # the ref-count scale
    assert figure["data"][1]["colorbar"]["title"]["text"] == "ref count"


def test_heatmap_hover_names_block_owners_and_text(run) -> None:
    _, (mirror, snapshot), _, _ = run
    figure = pool_heatmap(mirror, decode=lambda ids: "".join(map(chr, ids)))
    first_block = snapshot.sequences[0].block_table[0]
    row, column = divmod(first_block, HEATMAP_COLUMNS)
    block_id, ref_count, state, owners, hash_prefix, text = (
        figure["data"][0]["customdata"][row][column])
    assert (block_id, state) == (first_block, "shared")
    assert ref_count == 2 and set(owners.split(", ")) == {s.seq_id for s in snapshot.sequences}
    assert hash_prefix == snapshot.blocks[first_block].block_hash[:12]
    assert text == hover_text("".join(map(chr, snapshot.blocks[first_block].token_ids)), 32)


def test_block_table_map_lines_up_shared_prefixes(run) -> None:
    _, (mirror, snapshot), _, _ = run
    figure = block_table_map(mirror)
    heatmap = figure["data"][0]
    holders = sorted((seq for seq in snapshot.sequences if seq.block_table),
                     key=lambda seq: seq.arrival_time, reverse=True)
    assert len(heatmap["y"]) == len(holders) == 2
    for seq, texts in zip(holders, heatmap["text"]):
        assert [int(text.split("<br>")[0]) for text in texts] == list(seq.block_table)
    assert heatmap["text"][0][0] == heatmap["text"][1][0]  # the same physical block in both
    assert "/" in heatmap["text"][0][-1]  # the last block shows its fill
    assert figure["layout"]["title"]["text"].startswith("Block tables: 2 of 2 sequences")


def tree_spans(icicle: dict, blocks) -> dict[str, list]:
    """Each drawn chain's blocks, head first, found by walking the hash chain up from its
    id (the hash of its last block) to its parent's (the root: a block without a cached
    parent). Fails if a node's parent is not where its chain leads."""
    hashed = {block.block_hash: block for block in blocks if block.block_hash}
    spans = {}
    for node, parent in zip(icicle["ids"], icicle["parents"], strict=True):
        if node in hashed:
            span, at = [], node
            while at in hashed and at != parent:
                span.append(hashed[at])
                at = hashed[at].parent_hash
            assert at == parent or (parent == "root" and at not in hashed)
            spans[node] = span[::-1]
    return spans


def test_prefix_tree_merges_each_chain_of_only_children_into_one_node(run) -> None:
    """A radix tree: every hashed block is in one drawn node, a node's blocks each the only
    child of the one before, and a node ends at a branch or where the ref count changes."""
    (mirror, snapshot), _, _, _ = run
    icicle = prefix_tree(mirror)["data"][0]
    hashed = {block.block_hash: block for block in snapshot.blocks if block.block_hash}
    children = Counter(block.parent_hash for block in hashed.values())
    spans = tree_spans(icicle, snapshot.blocks)
    assert sorted(block.block_hash for span in spans.values() for block in span) == sorted(
        hashed)
    for tail, span in spans.items():
        assert all(children[block.block_hash] == 1 for block in span[:-1])
        assert len({block.ref_count for block in span}) == 1
        if children[tail] == 1:
            only = next(block for block in hashed.values() if block.parent_hash == tail)
            assert only.ref_count != span[0].ref_count
    assert any(len(span) > 1 for span in spans.values())  # A's prompt is one chain


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
        record(0, [("r", "r", "prefill", 0, 4)]),
        record(1, [("r", "r", "decode", 4, 5)], preempted=["r"]),
        record(2, []),
        record(3, [("r", "r", "prefill", 0, 5)]),
    ])
    preempted = [s for s in spans if s.phase == "preempted"]
    assert [(s.start, s.end) for s in preempted] == [(1.5, 3)]


def test_a_timeline_of_many_sequences_says_how_many_it_leaves_out() -> None:
    records = [StepRecord(step, step, step + 0.5, ((
        f"r{step}", f"r{step}", "prefill", 0, 4),), (), (), (), (), 4, 8, 1, 0, 7, 1, 0)
        for step in range(MAX_TIMELINE_ROWS + 5)]
    figure = request_timeline(records)
    drawn = {row for trace in figure["data"] for row in trace["y"]}
    assert drawn == {f"r{step}" for step in range(5, MAX_TIMELINE_ROWS + 5)}  # the latest
    title = figure["layout"]["title"]["text"]
    assert f"{MAX_TIMELINE_ROWS} latest of {MAX_TIMELINE_ROWS + 5} sequences" in title
    assert "5 earlier in this window not drawn" in title
    whole = request_timeline(records[-3:])["layout"]["title"]["text"]
    assert whole == "Request timelines: 3 latest sequences"


def test_latency_stats_and_series(run) -> None:
    _, _, records, arrivals = run
    stats = latency_stats(records, arrivals)
    # A request's first token comes out of the step that ran its last prefill chunk (the
    # prompts take several chunks of 8 tokens).
    last_prefill = {request_id: max(record.end_time for record in records
                                    for chunk in record.chunks
                                    if chunk[0] == request_id and chunk[2] == "prefill")
                    for request_id in arrivals}
    assert stats.ttft == [last_prefill[r] - arrivals[r] for r in arrivals]
    assert len(stats.itl) == 3 + 7 + 7  # decodes after each sequence's first token
    span = records[-1].end_time - records[0].start_time
    assert stats.output_tokens_per_s == pytest.approx((4 + 2 * 8) / span)  # A's 4, B's 2 x 8
    assert len(pool_series(records)["data"][0]["y"]) == len(records)  # a saved session
    # Live: both usage lines from the same snapshots, so falling usage never draws more
    # token slots filled than the blocks in use hold.
    falling = [(records[0].start_time + i, b, t) for i, (b, t) in
               enumerate([(0.8, 0.6), (0.3, 0.2), (0.1, 0.05)])]
    blocks, tokens = pool_series(records, falling)["data"][:2]
    assert (blocks["name"], tokens["name"]) == ("blocks in use", "token slots filled")
    assert blocks["x"] == tokens["x"] and len(blocks["y"]) == 3
    assert all(t <= b for b, t in zip(blocks["y"], tokens["y"]))


def test_paged_memory_beats_a_contiguous_reservation(run) -> None:
    _, (during_b, _), _, _ = run
    comparison = compare_memory(during_b)
    assert comparison.num_sequences == 2
    assert comparison.contiguous_reserved_tokens == 2 * 128
    assert comparison.paged_reserved_tokens < comparison.contiguous_reserved_tokens
    assert comparison.paged_useful > comparison.contiguous_useful
    figure = paged_vs_contiguous(during_b)
    assert "20.4–38.2%" in figure["layout"]["title"]["text"]
    assert figure["layout"]["annotations"][0]["xanchor"] == "right"  # inside the plot
    assert figure["layout"]["xaxis"]["rangemode"] == "nonnegative"  # no negative ticks
    assert figure["data"][1]["text"] == [
        f"{comparison.contiguous_reserved_tokens} reserved",
        f"{comparison.paged_reserved_tokens} reserved"]  # the paged sliver says its size


# ---- pools far larger than the screen -------------------------------------------------------
LARGE = 100_003  # not a multiple of anything, so the last cell and row are partial


def synthetic_mirror(num_blocks: int, sequences=(), seed: int = 0) -> PoolMirror:
    """A mirror of a made-up pool: random ref counts (free, used, shared) and hashes
    (cached when free), chained in a few long prefixes so the prefix tree is deep."""
    rng = np.random.default_rng(seed)
    refs = rng.choice([0, 0, 0, 1, 2, 5], size=num_blocks)
    hashed = rng.random(num_blocks) < 0.3
    hashes, parent = [], None
    for block_id in np.flatnonzero(hashed).tolist():
        value = block_id.to_bytes(16, "little")
        hashes.append((block_id, (value, parent, (block_id,))))
        parent = value if rng.random() < 0.9 else None  # a new chain now and then
    counters = PoolCounters(0, 0.0, num_blocks, 1, len(sequences), 0, 0, 0, 0, 0,
                            {"max_model_len": 64})
    mirror = PoolMirror()
    mirror.apply(PoolBase(0, 0, counters, tuple(sequences)))
    mirror.apply(PoolSlice(0, 0, tuple(refs.tolist()), tuple(hashes)))
    assert mirror.ready
    return mirror


def sequence(seq_id: str, table: list[int], arrival: float) -> SequenceChange:
    return SequenceChange(seq_id, seq_id, "running", len(table), len(table), len(table),
                          arrival, 0, tuple(table), 0, tuple(range(len(table))))


def test_a_large_pool_is_drawn_in_aggregate_cells_that_count_every_block() -> None:
    mirror = synthetic_mirror(LARGE)
    figure = pool_heatmap(mirror)
    image = figure["data"][0]
    cell = -(-LARGE // MAX_CELLS)
    assert image["type"] == "image" and image["dx"] == cell
    counts = plotly_array(image["customdata"]).reshape(-1, len(STATES)).astype(int)
    assert counts.shape[0] <= MAX_CELLS + HEATMAP_COLUMNS  # padding of the last row only
    # The cells' counts add up to the pool's, state by state, and each cell is its range.
    assert dict(zip(STATES, counts.sum(axis=0).tolist())) == mirror.counts()
    codes = mirror.state_codes()
    for index in (0, 17, len(cell_counts(mirror, 0, LARGE, cell)) - 1):
        expected = np.bincount(codes[index * cell:(index + 1) * cell], minlength=4)
        assert counts[index].tolist() == expected.tolist()
    assert f"one cell = {cell} blocks" in figure["layout"]["title"]["text"]
    # Compact: numpy arrays go out as typed arrays, not per-cell strings.
    assert len(json.dumps(figure)) < 60_000


def test_zooming_shows_exact_blocks_with_hover_detail() -> None:
    mirror = synthetic_mirror(LARGE)
    figure = pool_heatmap(mirror, view="block range", start=50_000, stop=50_100)
    cells = heatmap_cells(figure)
    assert sorted(cells) == list(range(50_000, 50_100))
    assert [cells[b] for b in range(50_000, 50_100)] == mirror.state_codes(50_000, 50_100).tolist()
    assert figure["data"][0]["customdata"][0][5][0] == 50_005  # hover: the block itself
    assert "blocks 50000–50099: one cell per block" in figure["layout"]["title"]["text"]
    # Wider exact views keep block, state and ref count in the hover, as typed arrays.
    wide = pool_heatmap(mirror, view="block range", start=10_000, stop=10_000 + MAX_CELLS)
    assert len(heatmap_cells(wide)) == MAX_CELLS
    hover = plotly_array(wide["data"][0]["customdata"]).reshape(-1, 2)
    assert hover[:3].tolist() == [[b, mirror.ref_counts[b]] for b in range(10_000, 10_003)]
    # Out-of-pool ranges are clamped to the pool.
    assert sorted(heatmap_cells(pool_heatmap(mirror, view="block range", start=LARGE - 3,
                                             stop=LARGE + 50))) == list(range(LARGE - 3, LARGE))


def test_used_region_view_skips_the_idle_tail() -> None:
    refs = [0] * 10_000
    refs[700:900] = [1] * 200
    counters = PoolCounters(0, 0.0, 10_000, 1, 0, 0, 0, 0, 0, 0, {})
    mirror = PoolMirror()
    mirror.apply(PoolBase(0, 0, counters, ()))
    mirror.apply(PoolSlice(0, 0, tuple(refs), ()))
    cells = heatmap_cells(pool_heatmap(mirror, view="used region"))
    assert min(cells) == 640 and max(cells) == 899  # from the row holding block 700


def test_block_tables_say_how_many_they_leave_out_and_page() -> None:
    tables = [[i, 1000 + i] for i in range(43)]
    columns = table_columns(5000)
    assert columns < table_columns(100) < table_columns(10) == MAX_TABLE_COLUMNS
    tables[5] = list(range(2000, 2000 + 3 * columns))  # one long table
    mirror = synthetic_mirror(5000, [sequence(f"seq-{i}", table, float(i))
                                     for i, table in enumerate(tables)])
    figure = block_table_map(mirror)
    assert len(figure["data"][0]["y"]) == MAX_TABLE_ROWS
    assert figure["data"][0]["y"][0] == "seq-42 (running)"  # most recent first
    assert "32 of 43 sequences" in figure["layout"]["title"]["text"]
    assert "page 1 of 2" in figure["layout"]["title"]["text"]
    second = block_table_map(mirror, view=TableView(page=2))
    assert len(second["data"][0]["y"]) == 43 - MAX_TABLE_ROWS
    longest = block_table_map(mirror, view=TableView(order="longest"))
    assert longest["data"][0]["y"][0] == "seq-5 (running)"
    texts = [int(text.split("<br>")[0]) for text in longest["data"][0]["text"][0]]
    assert len(texts) == columns  # first and last halves of the long table
    assert texts[0] == 2000 and texts[-1] == 2000 + 3 * columns - 1
    assert "their first and last" in longest["layout"]["title"]["text"]
    ticks = longest["layout"]["xaxis"]["ticktext"]
    assert ticks[0] == "0" and ticks[-1] == "-1" and len(ticks) == columns  # from the end
    only = block_table_map(mirror, view=TableView(filter="seq-4"))
    assert sorted(only["data"][0]["y"]) == sorted(f"seq-{i} (running)" for i in (4, 40, 41, 42))
    with pytest.raises(ValueError, match="page=0"):
        TableView(page=0)


def test_a_large_prefix_tree_is_bounded_and_folds_small_subtrees() -> None:
    mirror = synthetic_mirror(20_000)
    icicle = prefix_tree(mirror)["data"][0]
    assert len(icicle["ids"]) <= MAX_TREE_NODES + 1
    hashed = np.flatnonzero(mirror.hashed)
    # Folding keeps the sizes: the root weighs the whole tree, a node at least its children.
    assert icicle["values"][0] == sum(1 + int(mirror.ref_counts[b]) for b in hashed)
    below = Counter()
    for parent, value in zip(icicle["parents"], icicle["values"], strict=True):
        below[parent] += value
    assert all(below[node] <= value for node, value in zip(icicle["ids"], icicle["values"]))
    assert any(re.fullmatch(r"\+\d+ more", label) for label in icicle["labels"])
    assert f"{len(hashed)} hashed blocks" in prefix_tree(mirror)["layout"]["title"]["text"]


def test_the_prefix_tree_counts_the_blocks_sharing_saves() -> None:
    shared = [0, 1, 2, 3]
    mirror = synthetic_mirror(64, [sequence(f"s{i}", [*shared, 10 + i], float(i))
                                   for i in range(3)])
    saved = mirror.blocks_saved_by_sharing
    assert saved == 3 * 5 - int(np.count_nonzero(mirror.ref_counts > 0))
    assert f"{saved} blocks saved by sharing" in prefix_tree(mirror)["layout"]["title"]["text"]


def test_the_prefix_tree_shows_each_nodes_hits_and_place_in_the_eviction_order(
        make_engine) -> None:
    """A runs, then B and C reuse A's first two blocks (two hits on each), then all finish:
    A's first two blocks are one node (one chain), its third and B's and C's own blocks
    branch from it. Each node's hover gives its hits and its blocks' places in the core's
    free queue (the next evicted first), and its label marks its hits and its first place."""
    core = make_engine("llama", block_size=4, num_gpu_blocks_override=32, max_model_len=64)
    a = list(range(10, 23))  # 13 tokens: three full blocks
    for prompt in (a, a[:8] + [90, 91, 92, 93, 94], a[:8] + [95, 96, 97, 98, 99]):
        core.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while core.has_unfinished_requests():
            core.step()
    pool = core.kv_cache.pool
    queue = [block.block_id for block in pool.free_queue if block.block_hash is not None]
    mirror = mirror_of(core)
    icicle = prefix_tree(mirror)["data"][0]
    spans = tree_spans(icicle, mirror.snapshot().blocks)
    assert sorted(len(span) for span in spans.values()) == [1, 1, 1, 2]
    assert sum(map(len, spans.values())) == len(queue)
    for node, label, custom in zip(icicle["ids"], icicle["labels"], icicle["customdata"],
                                   strict=True):
        if node not in spans:
            continue
        places = sorted(queue.index(block.block_id) + 1 for block in spans[node])
        hits = 2 if len(spans[node]) == 2 else 0
        order = f"#{places[0]}" + (f" to #{places[-1]}" if len(places) > 1 else "")
        assert custom[6] == hits and custom[7] == f"{order} of {len(queue)}, 1 = evicted next"
        assert label.endswith((f"×{hits} " if hits else "") + f"#{places[0]}")


def test_the_followed_requests_path_is_outlined_in_the_prefix_tree(run) -> None:
    """B (n=2) reused A's cached prefix: following B outlines exactly the tree's nodes that
    are B's blocks (its path from the root), A's own last blocks not."""
    mirror, snapshot = run[1]
    request_id = snapshot.sequences[0].request_id
    held = {block for seq in snapshot.sequences for block in seq.block_table}
    icicle = prefix_tree(mirror, follow=request_id)["data"][0]
    spans = tree_spans(icicle, snapshot.blocks)
    widths = icicle["marker"]["line"]["width"]
    outlined = {node for node, width in zip(icicle["ids"], widths, strict=True) if width == 3}
    # A chain ends where the followed request's blocks end: a node is all B's or none.
    on_path = {node: {block.block_id in held for block in span} for node, span in spans.items()}
    assert all(len(flags) == 1 for flags in on_path.values())
    assert outlined == {node for node, flags in on_path.items() if True in flags}
    assert outlined and len(outlined) < len(spans)  # A's own tail is not B's path
    outlined_blocks = sum(len(spans[node]) for node in outlined)
    assert f"following {request_id}: {outlined_blocks} of its" in \
        prefix_tree(mirror, follow=request_id)["layout"]["title"]["text"]
    assert set(prefix_tree(mirror)["data"][0]["marker"]["line"]["width"]) == {1}
