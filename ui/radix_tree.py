"""The prefix forest (ui.prefix_forest) as a radix tree, drawn as SGLang draws the tree of
RadixAttention: a chain of blocks, each the only child of the one before it, is one node
labelled with its text. Which nodes are drawn, and how much of each label, follows from
the width a node gets on screen, so every label drawn is whole and at least MIN_FONT_PX.

A chain also ends where the drawing's marks change: the ref count (and with it the state's
colour), whether the followed request holds the block, and after a block behind which a
state slot keeps a snapshot (a prefix hit can end there). Finding every chain is numpy,
pointer jumping in log2(longest chain) passes; Python touches only the nodes drawn.
"""

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvscope.ui.prefix_forest import PrefixForest, follow_pointers

# The tree shares its row with another panel: at a 1024 px wide page its plot is about
# this wide (wider pages only give labels room to spare).
TREE_PLOT_WIDTH_PX = 440
LABEL_FONT_PX = 12
MIN_FONT_PX = 11  # plotly shrinks a label down to this, and hides one that needs less
TEXT_PAD_PX = 8  # plotly's inset of a label (3 px a side) and the node's outline
# Glyph widths in em of the page's sans-serif fonts (Open Sans, DejaVu Sans, Arial), each
# class's widest with a margin: prose measures about 0.49 em a glyph in headless Chromium,
# this model 0.55, so a label sized with it fits its box at LABEL_FONT_PX.
NARROW_EM, PLAIN_EM, CAPITAL_EM, WIDE_EM = 0.36, 0.6, 0.75, 1.0
NARROW = frozenset(" .,;:'!|`ijlIft()[]")
WIDE = frozenset("mwMW@%…—")
MAX_TREE_NODES = 300


@dataclass(frozen=True, slots=True)
class RadixChains:
    """Per forest node h heading a chain (is_head[h]): its last node tail[h], its number
    of blocks, and the eviction places of its blocks (0 for blocks in use), first and
    last to go. Indices not heading a chain hold nothing meaningful."""

    is_head: np.ndarray
    tail: np.ndarray
    length: np.ndarray
    first_place: np.ndarray
    last_place: np.ndarray

    def nodes(self, forest: PrefixForest, head: int, limit: int) -> list[int]:
        """The chain's first `limit` forest nodes, from its head down."""
        nodes, node = [head], head
        while len(nodes) < min(limit, int(self.length[head])):
            node = int(forest.only_child[node])
            nodes.append(node)
        return nodes


def radix_chains(forest: PrefixForest, marks: np.ndarray, ends_after: np.ndarray,
                 places: np.ndarray) -> RadixChains:
    """Per forest node: `marks`, what a chain keeps throughout (a chain ends where it
    changes); `ends_after`, whether a chain must end at the node; `places`, its eviction
    place (0: in use)."""
    nodes = np.arange(len(forest))
    child = forest.only_child
    goes_on = (child >= 0) & ~ends_after
    goes_on[goes_on] = marks[child[goes_on]] == marks[goes_on]
    linked = forest.parent >= 0
    is_head = np.ones(len(forest), bool)
    is_head[linked] = ~goes_on[forest.parent[linked]]
    tail = follow_pointers(np.where(goes_on, child, nodes))[0]
    head_of = follow_pointers(np.where(is_head, nodes, np.maximum(forest.parent, 0)))[0]
    length = np.bincount(head_of, minlength=len(forest))
    first_place = np.full(len(forest), np.iinfo(np.int64).max)
    np.minimum.at(first_place, head_of, places)
    last_place = np.zeros(len(forest), np.int64)
    np.maximum.at(last_place, head_of, places)
    return RadixChains(is_head, tail, length, first_place, last_place)


@dataclass(slots=True)
class DrawnNode:
    """A node of the drawing: a chain (head, a forest node), the root (-1, parent -1) or
    `folded` sibling chains too narrow to label (head -1). `value`: the blocks' weight
    under it; `width_px`: its width where it is first seen (the whole tree on screen, or
    for a fold's members the fold opened); `undrawn`: branches under it left out
    (narrower than MIN_DRAWN_PX together, or past MAX_TREE_NODES)."""

    head: int
    parent: int
    value: int
    width_px: float
    folded: int = 0
    undrawn: int = 0


def glyph_em(glyph: str) -> float:
    if glyph in NARROW:
        return NARROW_EM
    if glyph in WIDE or not glyph.isascii():
        return WIDE_EM
    return CAPITAL_EM if glyph.isupper() or glyph.isdigit() else PLAIN_EM


def text_px(text: str) -> float:
    """The width a label needs: its glyphs at LABEL_FONT_PX and plotly's padding."""
    return sum(map(glyph_em, text)) * LABEL_FONT_PX + TEXT_PAD_PX


# A node is drawn on its own when one glyph of its text and the "…" fit it: narrower
# siblings fold into "+N more" (a node with no text to show says nothing without a hover),
# but for a lone one, drawn as itself.
MIN_NODE_PX = text_px("W…")
MIN_DRAWN_PX = 2  # a node narrower than this is no box to point at


def fold_label(count: int) -> str:
    return f"+{count} more"


def fit(text: str, width_px: float) -> str:
    """As much of `text` as fits `width_px` at LABEL_FONT_PX: whole words where it can,
    whole glyphs always, "…" where it stops short; "" if not even one glyph fits. Reads
    only the glyphs that fit (a node's text may be a long prompt)."""
    room, ellipsis = width_px - TEXT_PAD_PX, text_px("…") - TEXT_PAD_PX
    used, short = 0.0, 0  # short: the glyphs that fit beside an ellipsis
    for glyph in text:
        used += glyph_em(glyph) * LABEL_FONT_PX
        if used > room:
            break
        short += used + ellipsis <= room
    else:
        return text
    cut = text[:short]
    space = cut.rfind(" ")
    cut = (cut[:space] if space >= short // 2 else cut).rstrip()
    return cut + "…" if cut else ""


def drawn_nodes(forest: PrefixForest, chains: RadixChains,
                plot_width_px: float = TREE_PLOT_WIDTH_PX) -> list[DrawnNode]:
    """Breadth first, heaviest sibling first: the chains at least MIN_NODE_PX wide, the
    rest of a node's children folded into one "+N more" (a single one drawn as itself),
    at most MAX_TREE_NODES nodes; what is narrower than MIN_DRAWN_PX is left undrawn and
    counted. Drawn node 0 is the root; a node's parent precedes it. Widths are with the
    whole tree on screen, except under a "+N more": its siblings are its children, sized
    as a click on it shows them (zoomed to the plot's width), so they are there to open."""
    weight = forest.subtree_weight
    roots = forest.children(-1)
    total = int(weight[roots].sum())
    drawn = [DrawnNode(-1, -1, total, plot_width_px)]
    # (drawn node, its children, px per unit of weight, whether they are a fold's)
    frontier = deque([(0, roots, plot_width_px / max(total, 1), False)])
    while frontier:
        index, kids, px_per_weight, in_fold = frontier.popleft()
        if not kids.size:
            continue
        widths = weight[kids] * px_per_weight
        room = MAX_TREE_NODES + 1 - len(drawn)
        count = min(int(np.count_nonzero(widths >= MIN_NODE_PX)), room)
        if count == len(kids) - 1 and room > count and widths[-1] >= MIN_DRAWN_PX:
            count += 1  # one narrow sibling: itself, not "+1 more"
        elif count < len(kids):
            count = max(min(count, room - 1), 0)  # a place for the "+N more"
        for kid, width in zip(kids[:count].tolist(), widths[:count].tolist()):
            frontier.append((len(drawn), forest.children(int(chains.tail[kid])),
                             px_per_weight, False))
            drawn.append(DrawnNode(kid, index, int(weight[kid]), width))
        rest, fold_width = len(kids) - count, float(widths[count:].sum())
        # A fold of all a fold's children would fold forever: they stay undrawn. A fold
        # too narrow for its label is drawn; plotly hides the label until a zoom fits it.
        if rest and room > count and fold_width >= MIN_DRAWN_PX and not (
                in_fold and not count):
            fold_value = int(weight[kids[count:]].sum())
            frontier.append((len(drawn), kids[count:], plot_width_px / fold_value, True))
            drawn.append(DrawnNode(-1, index, fold_value, fold_width, folded=rest))
        elif rest:
            drawn[index].undrawn = rest
    return drawn
