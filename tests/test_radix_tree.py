"""The prefix tree as a radix tree (ui.radix_tree): chains merged, labels fitted, folds."""

import html
import sys
from pathlib import Path

import numpy as np

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolSlice
from kvscope.ui.figures import prefix_tree
from kvscope.ui.prefix_forest import prefix_forest
from kvscope.ui.radix_tree import (
    MAX_TREE_NODES,
    MIN_FONT_PX,
    MIN_NODE_PX,
    TREE_PLOT_WIDTH_PX,
    fit,
    text_px,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from prefix_tree_scale import decode_words, heavy_preset_mirror  # noqa: E402

# Block i holds token i; 0-1-2-3-4-5 is one prefix, then 6-7 and 8 branch from 5.
PARENTS = (-1, 0, 1, 2, 3, 4, 5, 6, 5)
REFS = (2, 2, 2, 1, 1, 1, 0, 0, 1)  # weight 1 + ref: each node wide enough to draw


def small_mirror() -> PoolMirror:
    value = [block.to_bytes(16, "little") for block in range(len(PARENTS))]
    hashes = tuple((block, (value[block], value[parent] if parent >= 0 else None, (block,)))
                   for block, parent in enumerate(PARENTS))
    mirror = PoolMirror()
    mirror.apply(PoolBase(0, 0, PoolCounters(0, 0.0, len(PARENTS) + 1, 1, 0, 0, 0, 0, 0, 0,
                                             {"max_model_len": 64}), ()))
    mirror.apply(PoolSlice(0, 0, (*REFS, 0), hashes))
    return mirror


def node_tokens(icicle: dict) -> list[str]:
    """Each chain node's text as its hover gives it."""
    return sorted(custom[5] for node, custom in zip(icicle["ids"], icicle["customdata"])
                  if node != "root")


def test_a_chain_of_only_children_is_one_node_until_a_branch_or_a_change_of_ref_count():
    icicle = prefix_tree(small_mirror(), decode_words)["data"][0]
    words = [decode_words((block,)) for block in range(len(PARENTS))]
    spans = ((0, 1, 2), (3, 4, 5), (6, 7), (8,))  # ref 2 | ref 1 | branches from 5
    assert node_tokens(icicle) == sorted(" ".join(words[b] for b in span) for span in spans)
    value = {block: (block).to_bytes(16, "little").hex() for block in range(len(PARENTS))}
    # A node's id is its last block's hash; its parent is the chain it continues.
    assert dict(zip(icicle["ids"], icicle["parents"])) == {
        "root": "", value[2]: "root", value[5]: value[2], value[7]: value[5],
        value[8]: value[5]}
    node = icicle["ids"].index(value[7])  # cached: blocks 6 and 7 go first
    assert icicle["customdata"][node][7] == "#1 to #2 of 2, 1 = evicted next"
    assert icicle["labels"][node].endswith("<br>#1")
    assert dict(zip(icicle["ids"], icicle["values"]))[value[5]] == 3 * 2 + 2 + 2


def test_a_chain_ends_at_a_state_slots_snapshot():
    snapshot_after = (1).to_bytes(16, "little").hex()
    icicle = prefix_tree(small_mirror(), decode_words, snapshots=frozenset({
        snapshot_after}))["data"][0]
    label = dict(zip(icicle["ids"], icicle["labels"]))[snapshot_after]
    assert label.endswith("state") and decode_words((0, 1)) in label
    assert len(icicle["ids"]) == 1 + 5  # 0-1 | 2 | 3-4-5 | 6-7 | 8


def test_subtree_weights_sum_each_nodes_descendants():
    """Against a walk up from every block: chains of only children, branchings, roots."""
    mirror = heavy_preset_mirror(3_000, seed=1)
    forest = prefix_forest(mirror)
    weight = 1 + mirror.ref_counts[forest.block_ids].astype(np.int64)
    expected = weight.copy()
    for node in range(len(forest)):
        up = forest.parent[node]
        while up >= 0:
            expected[up] += weight[node]
            up = forest.parent[up]
    assert forest.subtree_weight.tolist() == expected.tolist()


def test_fit_keeps_whole_words_where_it_can_and_whole_glyphs_always():
    text = "the paged attention design"
    assert fit(text, text_px(text)) == text
    assert fit(text, text_px("the paged a…")) == "the paged…"
    assert fit("attention", text_px("atte…")) == "atte…"
    assert fit(" attention", text_px(" a…") - 1) == ""  # never a lone "…"
    assert fit(text, text_px("t")) == ""
    for width in range(10, 200, 3):
        assert text_px(fit(text, width)) <= width


def test_at_70k_blocks_the_tree_is_bounded_and_every_label_fits_its_node():
    """The load generator's heavy preset at block_size 1: one trunk of the system prompt,
    many narrow chains of their own. Every label fits its node at the width it is seen at:
    the whole tree's, or under a "+N more", the fold's once a click zooms into it."""
    mirror = heavy_preset_mirror(70_000)
    forest = prefix_forest(mirror)
    icicle = prefix_tree(mirror, decode_words)["data"][0]
    assert 1 < len(icicle["ids"]) <= MAX_TREE_NODES + 1
    assert icicle["values"][0] == int(forest.subtree_weight[forest.children(-1)].sum())
    folds = [(label, custom[0]) for node, label, custom in
             zip(icicle["ids"], icicle["labels"], icicle["customdata"]) if node.endswith("/more")]
    assert folds and all(label == f"+{hover.split()[0]} more" for label, hover in folds)
    parent_of = dict(zip(icicle["ids"], icicle["parents"]))
    value_of = dict(zip(icicle["ids"], icicle["values"]))

    def seen_in(node: str) -> str:  # the node a click zoomed into, to show this one
        parent = parent_of[node]
        return parent if parent in ("", "root") or parent.endswith("/more") else seen_in(parent)

    for node, label in zip(icicle["ids"], icicle["labels"]):
        if node != "root":
            scope = seen_in(node) or "root"
            width = value_of[node] / value_of[scope] * TREE_PLOT_WIDTH_PX
            if node.endswith("/more"):  # a label too wide is hidden by plotly, not cut
                continue
            assert all(text_px(html.unescape(line)) <= width for line in label.split("<br>")
                       if line)


# Every slice of the drawn icicle: its node, the box drawn, and its label as drawn (the
# text, its size on screen after any shrinking plotly did, and the box the glyphs take).
DRAWN_SLICES = """(id) => {
    const plot = document.querySelector(`#${id} [data-testid="plotly"]`);
    const unit = plot.querySelector("svg.main-svg").getScreenCTM().a;
    const rect = (element) => { const r = element.getBoundingClientRect();
                                return [r.left, r.top, r.right, r.bottom]; };
    return Array.from(plot.querySelectorAll("g.slice")).map((slice) => {
        const text = slice.querySelector("text.slicetext");
        const shown = text && getComputedStyle(text).display !== "none"
            && text.textContent.trim() !== "" && text.getBoundingClientRect().width > 0;
        return {id: slice.__data__.data.data.id, box: rect(slice.querySelector("path")),
                text: shown ? text.textContent : null, glyphs: shown ? rect(text) : null,
                font_px: shown ? parseFloat(getComputedStyle(text).fontSize)
                                 * text.getScreenCTM().a / unit : null};
    });
}"""


def test_browser_under_the_heavy_preset_every_label_is_whole_and_at_least_11_px(
        tiny_chat_model_path, browser, tmp_path) -> None:
    """The load generator's heavy preset ("Pool pushed into preemption") at block_size 1,
    drawn by the dashboard at a 1024 px wide page: every label drawn is the node's label
    whole (plotly neither cut it nor hid part of it), at least MIN_FONT_PX on screen and
    inside its box, and the 20 largest nodes on screen (of those wide enough for a glyph)
    show their text without a hover."""
    from conftest import dashboard_served, wait_until
    from test_dashboard import drawn_figure

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.async_engine import AsyncEngine
    from kvscope.ui.loadgen import LoadGenerator

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=1,
        num_gpu_blocks_override=2048, max_model_len=256, max_num_batched_tokens=256)).start()
    try:
        with dashboard_served(engine, tmp_path / "kvscope.db") as (_, url):
            load = LoadGenerator(engine)
            load.start_scenario("Pool pushed into preemption")
            wait_until(lambda: load.runs[-1].ended is not None, timeout=240,
                       what="the heavy preset's requests to end")
            assert load.runs[-1].finished == load.runs[-1].spec.num_requests
            page = browser.new_page(viewport={"width": 1024, "height": 900})
            page.goto(url)
            page.locator("#kv-prefix-tree").scroll_into_view_if_needed()
            drawn = []

            def settled() -> bool:  # the last request's end is drawn: two reads agree
                figure = drawn_figure(page, "kv-prefix-tree")
                ids = figure and figure["data"] and figure["data"][0].get("ids")
                drawn.append(ids)
                page.wait_for_timeout(1500)
                return bool(ids) and len(ids) > 3 and drawn[-2:] == [ids, ids]
            wait_until(settled, timeout=60, what="the prefix tree of the ended load")
            icicle = drawn_figure(page, "kv-prefix-tree")["data"][0]
            slices = page.evaluate(DRAWN_SLICES, "kv-prefix-tree")
            page.close()
    finally:
        engine.shutdown()
    label_of = dict(zip(icicle["ids"], icicle["labels"], strict=True))
    text_of = dict(zip(icicle["ids"], (custom[5] for custom in icicle["customdata"])))
    labelled = [piece for piece in slices if piece["text"] is not None]
    assert len(labelled) > 3
    for piece in labelled:
        assert piece["font_px"] >= MIN_FONT_PX - 0.01, piece
        assert piece["text"] == html.unescape(label_of[piece["id"]].replace("<br>", "")), piece
        (left, top, right, bottom), glyphs = piece["box"], piece["glyphs"]
        assert left - 1 <= glyphs[0] and glyphs[2] <= right + 1, piece
        assert top - 1 <= glyphs[1] and glyphs[3] <= bottom + 1, piece
    chains = [piece for piece in slices if piece["id"] in text_of and piece["id"] != "root"
              and not piece["id"].endswith("/more")]

    def area(piece) -> float:
        left, top, right, bottom = piece["box"]
        return (right - left) * (bottom - top)
    # A fold's members are labelled for the width a click on the fold gives them (hidden
    # till then), and a lone narrow sibling has no room for a glyph.
    parent_of = dict(zip(icicle["ids"], icicle["parents"], strict=True))

    def in_fold(node: str) -> bool:
        return node.endswith("/more") or bool(parent_of[node]) and in_fold(parent_of[node])
    wide = [piece for piece in chains if piece["box"][2] - piece["box"][0] >= MIN_NODE_PX
            and not in_fold(piece["id"])]
    assert len(wide) >= 8
    for piece in sorted(wide, key=area, reverse=True)[:20]:
        first_line = html.unescape(label_of[piece["id"]].split("<br>")[0]).rstrip("…")
        assert piece["text"] and first_line.strip(), (piece, label_of[piece["id"]])
        hover = " ".join(html.unescape(text_of[piece["id"]].replace("<br>", " ")).split())
        assert hover.startswith(" ".join(first_line.split())), piece
