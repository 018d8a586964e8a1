"""Why a prompt's prefix-cache lookup stopped where it did, on a prefix seen before.

The pool keeps three bounded LRU maps (a fixed number of entries each, so a long run costs
no more than a short one): recently evicted block hashes -> who evicted them and when,
recently cached blocks' parents -> the tokens that followed, and recently cached first
blocks' unsalted hashes -> the cache_salt they were cached under. When a prompt's lookup
stops at a block, the first says whether that block was cached once and evicted (and by
whom), the third (at the first block) whether the same tokens are cached under another
salt (salts keep requests from sharing a prefix), the second whether the prompt shared
text with a cached block that ends mid-block (such tokens can never hit: only full blocks
are cached). A block a lower tier
(engine.core.kv_offload) loaded back is in the pool again, so it is a hit, never a miss.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

RECENT_ENTRIES = 4096  # per map: ~1 MB at most, and a miss older than that is unexplained

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """A map keeping the `capacity` most recently put keys (a put refreshes a key)."""

    def __init__(self, capacity: int = RECENT_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, key: K) -> V | None:
        return self._entries.get(key)


@dataclass(frozen=True, slots=True)
class Eviction:
    """A cached block's content was dropped so that request `by` could have its block, while
    the engine scheduled step `step`."""

    by: str
    step: int


def common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens two runs share."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))
