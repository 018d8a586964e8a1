"""The order requests are served in: vLLM's `--scheduling-policy`, fcfs or priority.

fcfs serves requests in arrival order (a preempted or resumed one first again). priority
serves the lowest `priority` value first, as vLLM does, with aging so that low priority
cannot starve:

    rank = priority * priority_aging_steps + the scheduler step the request arrived at

and the waiting queue, the preemption victims and the order a step visits sequences in
all follow (rank, arrival time), lowest first. A waited step counts as 1/priority_aging_steps
of a priority level, and the rank never changes once given, so a preempted request goes
back to the very place it had.

The aging bound: a request of priority p can be ranked behind a request of priority q that
arrived after it only if that one arrived within (p - q) * priority_aging_steps scheduler
steps of it. After waiting that long, no later arrival of priority >= q goes ahead of it
(nor preempts it), whatever the load.
"""

import bisect
from collections.abc import Iterator

from kvscope.engine.core.request import Request, Sequence

# vLLM takes any int; kvscope takes a 32-bit signed one, so a rank stays a plain number a
# log and a dashboard can show, and a typo'd huge value is refused instead of parking a
# request forever.
PRIORITY_MIN, PRIORITY_MAX = -(2 ** 31), 2 ** 31 - 1


def check_priority(priority: object, policy: str) -> int:
    """The priority as given, or a ValueError naming `priority`, its range, and the policy
    that honours it (under fcfs only the default 0 is accepted, as in vLLM)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority={priority!r} must be an integer in "
                         f"[{PRIORITY_MIN}, {PRIORITY_MAX}], lower served first")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority={priority} is outside [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority={priority} needs scheduling_policy='priority'; under "
                         f"{policy!r} requests are served in arrival order, so only the "
                         "default priority=0 is accepted")
    return priority


def rank(request: Request, policy: str, aging_steps: int, step: int) -> int:
    """A new request's rank (see the module's doc); every request ranks 0 under fcfs."""
    return request.priority * aging_steps + step if policy == "priority" else 0


class RankedQueue:
    """The waiting queue under the priority policy: sequences kept sorted by
    Sequence.priority_key, with the few deque operations the scheduler uses. Whether a
    sequence is new (`append`) or preempted (`appendleft`), its rank places it."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._seqs: list[Sequence] = []
        self._counter = 0  # equal keys keep their insertion order

    def append(self, seq: Sequence) -> None:
        self._counter += 1
        key = (*seq.priority_key, self._counter)
        index = bisect.bisect(self._keys, key)
        self._keys.insert(index, key)
        self._seqs.insert(index, seq)

    appendleft = append

    def popleft(self) -> Sequence:
        del self._keys[0]
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        index = next(i for i, other in enumerate(self._seqs) if other is seq)
        del self._keys[index], self._seqs[index]

    def __getitem__(self, index: int) -> Sequence:
        return self._seqs[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return any(other is seq for other in self._seqs)
