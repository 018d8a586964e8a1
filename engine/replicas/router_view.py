"""The router's belief against the truth: per replica, the prefix index's blocks beside
the blocks the replica's pool holds, how far behind the index is, and the routed
requests' predicted hits against their actual ones (engine.replicas.hit_outcomes)."""

from dataclasses import dataclass

from kvscope.engine.replicas.hit_outcomes import HitOutcome, HitTotals
from kvscope.engine.replicas.prefix_index import PrefixIndex
from kvscope.engine.replicas.replica import CachedPrefixes


@dataclass(frozen=True, slots=True)
class IndexComparison:
    """One replica's blocks as the router's index believes them and as its pool holds
    them. The replica answers first, the index is read when the answer arrives: under
    load the index may meanwhile have applied events the answer predates, so a busy
    replica's differences are approximate, an idle one's exact."""

    replica: int
    believed_blocks: int  # hashes the index holds from the replica's block events
    guessed_blocks: int  # routed prompts' blocks counted without the replica's word yet
    cached_blocks: int  # hashes the replica's pool holds (in use or cached-free)
    believed_but_evicted: int  # in the index, gone from the pool
    cached_but_unknown: int  # in the pool, not in the index
    age_s: float | None  # since the index last applied the replica's events
    events_behind: int | None  # block events the replica had that the index had not


@dataclass(frozen=True, slots=True)
class RouterView:
    """What the dashboard's router panel shows (EngineView.router_view)."""

    block_size: int
    replicas: tuple[IndexComparison, ...]  # the live replicas'
    outcomes: tuple[HitOutcome, ...]  # the recent routed requests, oldest first
    totals: HitTotals  # over every settled request since the start


def compare_index(index: PrefixIndex, truth: CachedPrefixes) -> IndexComparison:
    believed = index.held(truth.replica)
    sync = index.synced(truth.replica)
    return IndexComparison(
        truth.replica, len(believed), len(index.guessed(truth.replica)), len(truth.hashes),
        len(believed - truth.hashes), len(truth.hashes - believed),
        None if sync is None else index.now() - sync.time,
        # Below 0: the index applied a poll newer than the answer (it had caught up).
        None if sync is None else max(0, truth.event_seq - sync.event_seq))
