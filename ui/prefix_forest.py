"""The prefix cache's hash chains as a forest of arrays: every hashed block linked to its
parent's block and weighed by its subtree, in numpy.

The prefix tree draws a few hundred nodes, but choosing them needs every subtree's size.
Built with Python dicts and loops that cost about a second per million cached blocks
(docs/performance-history.md, 'Figures the code's comments quoted'); here it is a sort, a
binary search, log2(depth) pointer jumps and one scatter-add per depth level.
"""

from dataclasses import dataclass

import numpy as np

from kvscope.engine.telemetry.pool_mirror import PoolMirror


@dataclass(frozen=True, slots=True)
class PrefixForest:
    """Node i is hashed block block_ids[i] (ascending ids); parent[i] is a node index, or
    -1 where the block's parent is not cached (a first block, or its parent was evicted)."""

    block_ids: np.ndarray
    parent: np.ndarray
    subtree_weight: np.ndarray  # sum of (1 + ref count) over the node's subtree
    num_children: np.ndarray
    only_child: np.ndarray  # the child of a node with exactly one, else -1
    _child_order: np.ndarray  # node indices ordered by parent, ascending ids within
    _child_parent: np.ndarray  # parent[_child_order]

    def __len__(self) -> int:
        return len(self.block_ids)

    def children(self, node: int) -> np.ndarray:
        """Child node indices of `node` (-1: the roots), heaviest subtree first."""
        start, stop = np.searchsorted(self._child_parent, (node, node + 1))
        kids = self._child_order[start:stop]
        return kids[np.argsort(-self.subtree_weight[kids], kind="stable")]


def prefix_forest(pool: PoolMirror) -> PrefixForest:
    block_ids = np.flatnonzero(pool.hashed)
    keys, parent_keys = pool.hash_keys[block_ids], pool.parent_keys[block_ids]
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    parent = np.full(len(block_ids), -1, np.int64)
    if len(block_ids):
        at = np.minimum(np.searchsorted(sorted_keys, parent_keys), len(block_ids) - 1)
        linked = pool.has_parent[block_ids] & (sorted_keys[at] == parent_keys)
        parent[linked] = by_key[at[linked]]
    child_order = np.argsort(parent, kind="stable")
    child_parent = parent[child_order]
    # Children of node i sit in child_order[first_child[i] : first_child[i] + count].
    first_child = np.searchsorted(child_parent, np.arange(len(parent)))
    num_children = np.searchsorted(child_parent, np.arange(len(parent)), side="right") - (
        first_child)
    only_child = np.full(len(parent), -1, np.int64)
    single = num_children == 1
    only_child[single] = child_order[first_child[single]]
    weight = 1 + pool.ref_counts[block_ids].astype(np.int64)
    subtree_weight = _subtree_sums(parent, weight, child_order, child_parent, first_child,
                                   num_children)
    return PrefixForest(block_ids, parent, subtree_weight, num_children, only_child,
                        child_order, child_parent)


def follow_pointers(pointer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each node's chain of pointers ends (at a node pointing at itself), and in how
    many steps: pointer jumping, doubling the distance covered each pass."""
    steps = (pointer != np.arange(len(pointer))).astype(np.int64)
    while True:
        further = pointer[pointer]
        if np.array_equal(further, pointer):
            return pointer, steps
        steps = steps + steps[pointer]
        pointer = further


def _subtree_sums(parent: np.ndarray, weight: np.ndarray, child_order: np.ndarray,
                  child_parent: np.ndarray, first_child: np.ndarray,
                  num_children: np.ndarray) -> np.ndarray:
    """Each node's weight plus its descendants'. A chain of only children (a prompt at
    block_size 1 is one as long as itself) is summed at once, from its tail up; the chains
    are then summed into their parents level by level, deepest first, the levels found
    top-down from the roots (one vectorised expansion per level): as many levels as a
    path has branchings, not blocks."""
    if not len(parent):
        return weight.copy()
    nodes = np.arange(len(parent))
    linked = parent >= 0
    is_head = np.ones(len(parent), bool)
    is_head[linked] = num_children[parent[linked]] != 1
    head, depth = follow_pointers(np.where(is_head, nodes, np.maximum(parent, 0)))
    # Chains contiguous, each from its head down: a suffix sum within each is its nodes'
    # weight to the chain's tail.
    order = np.lexsort((depth, head))
    starts = np.flatnonzero(is_head[order])
    stops = np.append(starts[1:], len(order))
    chain_of = np.cumsum(is_head[order]) - 1
    suffix = np.append(np.cumsum(weight[order][::-1])[::-1], 0)
    to_tail = np.empty_like(weight)
    to_tail[order] = suffix[:-1] - suffix[stops[chain_of]]
    tail = np.empty_like(parent)
    tail[order[starts]] = order[stops - 1]
    levels = []
    level = child_order[:np.searchsorted(child_parent, 0)]  # the roots (parent -1)
    while level.size:
        levels.append(level)
        ends = tail[level]
        counts = num_children[ends]
        stop = np.cumsum(counts)
        at = np.repeat(first_child[ends] - stop + counts, counts) + np.arange(
            stop[-1] if stop.size else 0)
        level = child_order[at]
    below = np.zeros_like(weight)  # per chain head: the chains under its tail
    for level in reversed(levels[1:]):
        np.add.at(below, head[parent[level]], to_tail[level] + below[level])
    return to_tail + below[head]
