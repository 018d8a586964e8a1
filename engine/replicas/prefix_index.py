"""The router's global prefix index: which replica holds which KV block hashes.

Fed by each replica's block events (hashes stored in / evicted from its pool) and keyed by
the prefix cache's own chained hash (kvscope.engine.core.block_pool.hash_block_tokens), so a prompt's
leading full blocks can be matched against every replica without asking any of them.
"""

import time
from collections.abc import Iterable, Sequence

from kvscope.engine.core.block_pool import hash_block_tokens

# A routed prompt's blocks count as held by its replica this long before the replica's
# own events confirm them: a burst of requests sharing a new prefix then sticks to the
# replica the first one went to, instead of spreading before any block was stored.
ROUTED_PREFIX_TTL_S = 10.0


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them
    (an empty list when the ids are not all integers: the replica refuses those)."""
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in token_ids):
        return []
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._held: dict[int, set[bytes]] = {}  # replica -> hashes its pool holds
        self._routed: dict[int, dict[bytes, float]] = {}  # replica -> hash -> expiry

    def apply(self, replica: int, stored: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        """One replica's block events, in the order they happened (evictions first, as
        the replica's tracker emits a reused block's old hash before its new one)."""
        held = self._held.setdefault(replica, set())
        routed = self._routed.get(replica, {})
        for block_hash in evicted:
            held.discard(block_hash)
            routed.pop(block_hash, None)
        for block_hash in stored:
            held.add(block_hash)
            routed.pop(block_hash, None)

    def note_routed(self, replica: int, hashes: Iterable[bytes]) -> None:
        expiry = self._clock() + ROUTED_PREFIX_TTL_S
        routed = self._routed.setdefault(replica, {})
        for block_hash in hashes:
            routed[block_hash] = expiry

    def drop(self, replica: int) -> None:
        """The replica is gone (or restarted with an empty pool)."""
        self._held.pop(replica, None)
        self._routed.pop(replica, None)

    def matched_blocks(self, replica: int, hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks the replica holds (a chained hash
        matches only if every block before it matches too, so the count stops at the
        first miss)."""
        held = self._held.get(replica, set())
        routed = self._routed.get(replica, {})
        now = self._clock()
        count = 0
        for block_hash in hashes:
            if block_hash not in held and routed.get(block_hash, 0.0) <= now:
                break
            count += 1
        return count

    def num_blocks(self, replica: int) -> int:
        return len(self._held.get(replica, ()))
