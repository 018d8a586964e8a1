"""What each request cost the KV cache, kept step by step for its RequestOutput.

The meter reads each step's plan: the blocks its scheduled sequences hold, for how long the
step ran, the tokens it computed, and what the step's preemptions took from whom. A request
leaves the meter with its last output (finished or aborted), so it holds only live ones.
"""

from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.outputs import KVCost


class KVCostMeter:
    def __init__(self) -> None:
        self._costs: dict[str, KVCost] = {}

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        """One step of `seconds` ran `plan`."""
        held: dict[str, int] = {}
        for item in plan.scheduled:
            seq = item.seq
            cost = self._cost(seq.request.request_id)
            cost.computed_tokens += item.num_real_tokens
            # Block table entries less the sliding window's released ones, per sequence
            # (O(1) a sequence: a set of ids per step would cost the table's length).
            held[seq.request.request_id] = (held.get(seq.request.request_id, 0)
                                            + len(seq.block_table) - seq.num_released_blocks)
        for request_id, blocks in held.items():
            cost = self._costs[request_id]
            cost.blocks_peak = max(cost.blocks_peak, blocks)
            cost.block_seconds += blocks * seconds
        for event in plan.preemptions:
            self._cost(event.seq.request.request_id).tokens_recomputed += event.tokens_lost

    def cost(self, request: Request) -> KVCost:
        """The request's cost so far (a copy), its prefix-cache share filled in."""
        cost = self._costs.get(request.request_id) or KVCost()
        return KVCost(cost.blocks_peak, round(cost.block_seconds, 6), cost.tokens_recomputed,
                      request.num_cached_tokens, cost.computed_tokens)

    def forget(self, request_id: str) -> None:
        self._costs.pop(request_id, None)

    def _cost(self, request_id: str) -> KVCost:
        cost = self._costs.get(request_id)
        if cost is None:
            cost = self._costs[request_id] = KVCost()
        return cost
