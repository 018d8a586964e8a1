"""KV cache groups: the model's attention layers split by attention type (full, or a
sliding window of W positions), each group with its own block table per sequence.

All groups share one block pool. A pool block holds K and V for `block_size` tokens in
`layers_per_block` layers: block b of group g holds the keys of g's i-th layer in layer
slot i (ModelRunner.allocate_kv_cache). So every group has the same number of layers (the
last group of a type may leave slots unused), and a block id means the same bytes in every
group: a block freed by a sliding group can be taken by the full group next. This is vLLM
v1's layout (kv_cache_utils: uniform page size, tensors shared across groups);
docs/architecture.md, "Sliding windows", explains the choice.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that allocate and free blocks together."""

    window: int | None  # None: full attention (keeps every block)
    layers: tuple[int, ...]  # attention layer indices; layers[i] uses the pool's layer slot i


def kv_cache_groups(windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Group the layers whose windows (None: full attention) are `windows`.

    Each attention type's layers, in order, are cut into groups of the smallest type's
    layer count (vLLM's choice: Gemma 3 1B's 4 global and 22 sliding layers make one full
    group and six sliding groups of 4 layers, the last holding 2). A model of one type is
    one group of all its layers: today's single block table.
    """
    if not windows:
        raise ValueError("kv_cache_groups: the model has no attention layer")
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    sliding = [window for window in by_type if window is not None]
    if len(sliding) > 1:
        # The manager frees all sliding groups' blocks in step (one released count per
        # sequence); no supported architecture mixes windows.
        raise ValueError(f"model: layers with sliding windows {sorted(sliding)}: one window "
                         "size per model is supported")
    size = min(len(layers) for layers in by_type.values())
    groups = [KVCacheGroup(window, tuple(layers[start:start + size]))
              for window, layers in by_type.items() for start in range(0, len(layers), size)]
    return sorted(groups, key=lambda group: group.layers[0])


def layers_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """The layer slots of a pool block: the largest group's layer count."""
    return max(len(group.layers) for group in groups)
