"""The router's predicted prefix hits against the hits the replicas had.

At routing, the prefix index's match on the chosen replica predicts how many prompt
tokens the replica will find cached; when the request ends, the replica reports how many
it reused (RequestOutput.num_cached_tokens). A HitLedger keeps one HitOutcome per routed
request, the totals over the settled ones, and why a prediction fell short, read from
the first predicted block the replica did not reuse.
"""

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kvscope.engine.replicas.prefix_index import PrefixIndex

RECENT_OUTCOMES = 1_000


class MissReason(str, Enum):
    """Why a replica reused fewer prompt tokens than the router predicted."""

    # The index learned, after routing, that the replica evicted the block.
    EVICTED = "evicted"
    # The block was a routed prompt's guess (PrefixIndex.note_routed): the request sent
    # there earlier had not stored it when this one was scheduled.
    NOT_STORED_YET = "not stored yet"
    # The index still holds the block from the replica's events (or lost the replica's
    # state on a restart), yet the replica did not reuse it: a prompt-logprobs request,
    # a recurrent or sliding-window model's own rule, or an eviction not yet reported.
    NOT_REUSED = "not reused"


@dataclass(slots=True)
class HitOutcome:
    """One routed request: the hit the router predicted and the one its replica had."""

    request_id: str
    replica: int
    routed_at: float  # the prefix index's clock
    block_size: int
    num_prompt_tokens: int
    predicted_tokens: int  # the matched leading blocks the replica can reuse, in tokens
    confirmed_blocks: int  # of those, the blocks the replica's own events reported
    hashes: tuple[bytes, ...]  # the predicted blocks' hashes
    actual_tokens: int | None = None  # None until the replica reports the request's end
    reason: MissReason | None = None  # set when actual_tokens < predicted_tokens

    @property
    def missed_tokens(self) -> int:
        return max(0, self.predicted_tokens - (self.actual_tokens or 0))

    @property
    def unforeseen_tokens(self) -> int:
        """Tokens the replica reused that the router did not know it held."""
        return max(0, (self.actual_tokens or 0) - self.predicted_tokens)


@dataclass(slots=True)
class HitTotals:
    """Sums over the settled outcomes (predicted = hit + missed; actual = hit + unforeseen)."""

    requests: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    missed_tokens: int = 0
    unforeseen_tokens: int = 0
    misses: int = 0  # requests that reused fewer tokens than predicted
    misses_by_reason: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: HitOutcome) -> None:
        self.requests += 1
        self.predicted_tokens += outcome.predicted_tokens
        self.actual_tokens += outcome.actual_tokens
        self.missed_tokens += outcome.missed_tokens
        self.unforeseen_tokens += outcome.unforeseen_tokens
        if outcome.reason is not None:
            self.misses += 1
            key = outcome.reason.value
            self.misses_by_reason[key] = self.misses_by_reason.get(key, 0) + 1

    def since(self, before: "HitTotals") -> "HitTotals":
        """What was added after `before` (an earlier copy of these totals)."""
        by_reason = {key: count - before.misses_by_reason.get(key, 0)
                     for key, count in self.misses_by_reason.items()}
        return HitTotals(*(getattr(self, f.name) - getattr(before, f.name)
                           for f in dataclasses.fields(self) if f.name != "misses_by_reason"),
                         misses_by_reason={k: v for k, v in by_reason.items() if v})


def reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt's blocks a prefix hit may cover: a replica always computes the last
    prompt token (its logits), so a block holding it is never reused."""
    return max(0, num_prompt_tokens - 1) // block_size


class HitLedger:
    """Outcomes of routed requests, opened at routing and settled when their replica
    reports their end. Used from the ReplicaSet's event-loop thread only."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.totals = HitTotals()
        self.recent: deque[HitOutcome] = deque(maxlen=RECENT_OUTCOMES)
        self._open: dict[str, HitOutcome] = {}

    def open(self, request_id: str, replica: int, matched_blocks: int,
             hashes: list[bytes], num_prompt_tokens: int, block_size: int) -> HitOutcome:
        """The router sent the request to `replica`, its index matching `matched_blocks`
        of the prompt's `hashes` (blocks of `block_size` tokens) there."""
        blocks = min(matched_blocks, reusable_blocks(num_prompt_tokens, block_size))
        predicted = tuple(hashes[:blocks])
        outcome = HitOutcome(request_id, replica, self.index.now(), block_size,
                             num_prompt_tokens, blocks * block_size,
                             self.index.matched_blocks(replica, predicted, confirmed_only=True),
                             predicted)
        self._open[request_id] = outcome
        self.recent.append(outcome)
        return outcome

    def settle(self, request_id: str, actual_tokens: int) -> HitOutcome | None:
        """The replica reused `actual_tokens` of the prompt (None: not a routed request)."""
        outcome = self._open.pop(request_id, None)
        if outcome is None:
            return None
        outcome.actual_tokens = actual_tokens
        if actual_tokens < outcome.predicted_tokens:
            outcome.reason = self._why(outcome, actual_tokens // outcome.block_size)
        self.totals.add(outcome)
        return outcome

    def abandon(self, request_id: str) -> None:
        """The request never reached a replica's scheduler (refused, aborted while
        waiting, or its replica died): nothing to compare."""
        self._open.pop(request_id, None)

    def _why(self, outcome: HitOutcome, first_missed: int) -> MissReason:
        if first_missed >= outcome.confirmed_blocks:
            return MissReason.NOT_STORED_YET
        if self.index.evicted_since(outcome.replica, outcome.hashes[first_missed],
                                    outcome.routed_at):
            return MissReason.EVICTED
        return MissReason.NOT_REUSED
