"""The router's global prefix index: which replica holds which KV block hashes.

Fed by each replica's block events (hashes stored in / evicted from its pool) and keyed by
the prefix cache's own chained hash (kvscope.engine.core.block_pool.hash_block_tokens), so a prompt's
leading full blocks can be matched against every replica without asking any of them.
"""

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvscope.engine.core.block_pool import hash_block_tokens

# A routed prompt's blocks count as held by its replica this long before the replica's
# own events confirm them: a burst of requests sharing a new prefix then sticks to the
# replica the first one went to, instead of spreading before any block was stored.
ROUTED_PREFIX_TTL_S = 10.0
# Evictions remembered per replica (oldest forgotten first), to tell why a predicted hit
# missed: the replica evicted the block after the router counted it.
EVICTIONS_KEPT = 100_000


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them,
    the request's cache_salt in the first (an empty list when the ids are not all integers:
    the replica refuses those)."""
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in token_ids):
        return []
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]),
                                   cache_salt if start == 0 else None)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class IndexSync:
    """How far the index has followed one replica: the replica's count of block events
    (stored + evicted) through the last batch applied, and when (the index's clock)."""

    event_seq: int
    time: float


class PrefixIndex:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._held: dict[int, set[bytes]] = {}  # replica -> hashes its pool holds
        self._routed: dict[int, dict[bytes, float]] = {}  # replica -> hash -> expiry
        self._evicted: dict[int, OrderedDict[bytes, float]] = {}  # replica -> hash -> when
        self._synced: dict[int, IndexSync] = {}

    def apply(self, replica: int, stored: Iterable[bytes], evicted: Iterable[bytes],
              event_seq: int | None = None) -> None:
        """One replica's block events, in the order they happened (evictions first, as
        the replica's tracker emits a reused block's old hash before its new one);
        `event_seq`: the replica's event count through this batch."""
        now = self._clock()
        held = self._held.setdefault(replica, set())
        routed = self._routed.get(replica, {})
        evictions = self._evicted.setdefault(replica, OrderedDict())
        for block_hash in evicted:
            held.discard(block_hash)
            routed.pop(block_hash, None)
            evictions[block_hash] = now
            evictions.move_to_end(block_hash)
        while len(evictions) > EVICTIONS_KEPT:
            evictions.popitem(last=False)
        for block_hash in stored:
            held.add(block_hash)
            routed.pop(block_hash, None)
        if event_seq is not None:
            self._synced[replica] = IndexSync(event_seq, now)

    def note_routed(self, replica: int, hashes: Iterable[bytes]) -> None:
        expiry = self._clock() + ROUTED_PREFIX_TTL_S
        routed = self._routed.setdefault(replica, {})
        for block_hash in hashes:
            routed[block_hash] = expiry

    def drop(self, replica: int) -> None:
        """The replica is gone (or restarted with an empty pool)."""
        self._held.pop(replica, None)
        self._routed.pop(replica, None)
        self._evicted.pop(replica, None)
        self._synced.pop(replica, None)

    def matched_blocks(self, replica: int, hashes: Sequence[bytes],
                       confirmed_only: bool = False) -> int:
        """How many of the prompt's leading blocks the replica holds (a chained hash
        matches only if every block before it matches too, so the count stops at the
        first miss); `confirmed_only`: by the replica's own events, not by a routed
        prompt's unconfirmed blocks."""
        held = self._held.get(replica, set())
        routed = {} if confirmed_only else self._routed.get(replica, {})
        now = self._clock()
        count = 0
        for block_hash in hashes:
            if block_hash not in held and routed.get(block_hash, 0.0) <= now:
                break
            count += 1
        return count

    def num_blocks(self, replica: int) -> int:
        return len(self._held.get(replica, ()))

    def held(self, replica: int) -> frozenset[bytes]:
        """The hashes the replica's events say its pool holds."""
        return frozenset(self._held.get(replica, ()))

    def guessed(self, replica: int) -> frozenset[bytes]:
        """The routed prompts' blocks still counted as held without the replica's word."""
        now, held = self._clock(), self._held.get(replica, set())
        return frozenset(block_hash for block_hash, expiry in self._routed.get(replica, {}).items()
                         if expiry > now and block_hash not in held)

    def evicted_since(self, replica: int, block_hash: bytes, since: float) -> bool:
        """Whether the index learned of the block's eviction from the replica after
        `since` (the index's clock)."""
        when = self._evicted.get(replica, {}).get(block_hash)
        return when is not None and when > since

    def synced(self, replica: int) -> IndexSync | None:
        """The replica's last applied batch that carried its event count (None: none yet)."""
        return self._synced.get(replica)

    def now(self) -> float:
        return self._clock()
