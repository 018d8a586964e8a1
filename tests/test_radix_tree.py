"""The prefix tree as a radix tree (ui.radix_tree): chains merged, labels fitted, folds."""

import html

from radix_pools import decode_words, heavy_preset_mirror

from kvscope.engine.telemetry.pool_mirror import PoolMirror
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolSlice
from kvscope.ui.figures import prefix_tree
from kvscope.ui.prefix_forest import prefix_forest
from kvscope.ui.radix_tree import (
    MAX_TREE_NODES,
    MIN_NODE_PX,
    TREE_PLOT_WIDTH_PX,
    fit,
    text_px,
)

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


def test_fit_keeps_whole_words_where_it_can_and_whole_glyphs_always():
    text = "the paged attention design"
    assert fit(text, text_px(text)) == text
    assert fit(text, text_px("x" * 12)) == "the paged…"
    assert fit("attention", text_px("x" * 5)) == "atte…"
    assert fit(text, text_px("x")) == ""
    for chars in range(2, 30):
        assert text_px(fit(text, text_px("x" * chars))) <= text_px("x" * chars)


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
            assert width >= MIN_NODE_PX
            assert all(text_px(html.unescape(line)) <= width for line in label.split("<br>"))
