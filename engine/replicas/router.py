"""Which replica serves a request: kv-aware, least-loaded or round-robin.

kv-aware scores each live replica as

    score = matched_blocks / prompt_blocks - load_weight * load
    load  = in_flight / max_num_seqs + kv_usage

where matched_blocks are the prompt's leading full blocks the replica already holds (from
the PrefixIndex), in_flight its routed, unfinished requests (running and waiting) and
kv_usage the fraction of its KV blocks in use at its last step. `load_weight` (default
1.0, `--routing-load-weight`) trades cache hits against balance: 0 sends every request
to the replica with the longest match whatever its queue, large values make kv-aware
least-loaded. Ties go to the less loaded, then (kv-aware) to the replica whose cache
holds fewer indexed blocks, so idle replicas take new prefixes in turn instead of the
first one collecting them all (as SGLang's router sends unmatched prompts to the smallest
cache), then to the lower-numbered replica.
"""

import itertools
import time
from dataclasses import dataclass

from kvscope.engine.replicas.prefix_index import PrefixIndex

ROUTING_POLICIES = ("kv-aware", "least-loaded", "round-robin")
DEFAULT_LOAD_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica: int
    in_flight: int
    kv_usage: float  # 0-1
    max_num_seqs: int

    @property
    def load(self) -> float:
        return self.in_flight / self.max_num_seqs + self.kv_usage


@dataclass(frozen=True, slots=True)
class CandidateScore:
    replica: int
    matched_blocks: int
    load: float
    score: float


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Why a request went where it went (shown on the dashboard, sent on /ws/events)."""

    request_id: str
    time: float
    policy: str
    replica: int
    num_prompt_blocks: int
    candidates: tuple[CandidateScore, ...]

    @property
    def matched_blocks(self) -> int:
        return next(c.matched_blocks for c in self.candidates if c.replica == self.replica)


def check_policy(policy: str) -> str:
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"routing={policy!r} must be one of {list(ROUTING_POLICIES)}")
    return policy


def check_load_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ValueError(f"routing_load_weight={weight!r} must be a number >= 0")
    return float(weight)


class Router:
    """Picks a replica among the live ones; the policy and weight change at run time."""

    def __init__(self, index: PrefixIndex, policy: str = "kv-aware",
                 load_weight: float = DEFAULT_LOAD_WEIGHT) -> None:
        self.index = index
        self.policy = check_policy(policy)
        self.load_weight = check_load_weight(load_weight)
        self._turns = itertools.count()

    def choose(self, request_id: str, prompt_hashes: list[bytes],
               loads: list[ReplicaLoad]) -> RoutingDecision:
        if not loads:
            raise ValueError("no live replica to route to")
        policy, weight = self.policy, self.load_weight  # one consistent read of the knobs
        num_blocks = len(prompt_hashes)
        candidates = []
        for load in loads:
            matched = self.index.matched_blocks(load.replica, prompt_hashes)
            if policy == "kv-aware":
                score = matched / max(1, num_blocks) - weight * load.load
            elif policy == "least-loaded":
                score = -load.load
            else:
                score = 0.0
            candidates.append(CandidateScore(load.replica, matched, load.load, score))
        if policy == "round-robin":
            chosen = candidates[next(self._turns) % len(candidates)]
        elif policy == "kv-aware":
            chosen = max(candidates, key=lambda c: (c.score, -c.load,
                                                    -self.index.num_blocks(c.replica), -c.replica))
        else:
            chosen = max(candidates, key=lambda c: (c.score, -c.load, -c.replica))
        if policy == "kv-aware":
            self.index.note_routed(chosen.replica, prompt_hashes)
        return RoutingDecision(request_id, time.time(), policy, chosen.replica, num_blocks,
                               tuple(candidates))
