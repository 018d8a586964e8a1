"""The tier's transfers counted by size, in vLLM's vllm:kv_offload_size buckets.

A transfer is one block written to the disk (GPU_to_DISK) or one prefix load placed in
the pool (DISK_to_GPU); its size is the bytes it moved, so the sizes sum to the bytes
counted under vllm:kv_offload_total_bytes.
"""

import math
from bisect import bisect_left
from dataclasses import dataclass, field

# vLLM's buckets (bytes), so its dashboards read kvscope's histogram the same way.
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


@dataclass(slots=True)
class TransferSizes:
    """Transfers per bucket (the last one holds those past the largest bound) and their
    bytes; counted since the tier opened."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(SIZE_BUCKETS) + 1))
    num_bytes: int = 0

    def observe(self, size: int) -> None:
        self.counts[bisect_left(SIZE_BUCKETS, size)] += 1  # a bound is inclusive (le)
        self.num_bytes += size

    def copy(self) -> "TransferSizes":
        return TransferSizes(list(self.counts), self.num_bytes)

    def __add__(self, other: "TransferSizes") -> "TransferSizes":
        return TransferSizes([a + b for a, b in zip(self.counts, other.counts, strict=True)],
                             self.num_bytes + other.num_bytes)

    def __radd__(self, other: int) -> "TransferSizes":
        """0 + sizes (sum(), and counters summed from zero, as the replicas' are)."""
        if other != 0:
            return NotImplemented
        return self.copy()

    def __sub__(self, other: "TransferSizes") -> "TransferSizes":
        """What was counted between two readings of one tier (`other` the earlier)."""
        return TransferSizes([a - b for a, b in zip(self.counts, other.counts, strict=True)],
                             self.num_bytes - other.num_bytes)

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus' buckets: (upper bound, transfers at or below it), inf last."""
        running, buckets = 0, []
        for bound, count in zip((*SIZE_BUCKETS, math.inf), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets
