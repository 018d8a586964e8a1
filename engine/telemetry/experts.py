"""A mixture-of-experts model's routing in the step records: how many of a step's tokens
each expert of each MoE layer took, the bytes of expert weights the step read, and the
same summed over recent steps (the dashboard's Experts panel, /metrics' expert load).

A step reads each expert its tokens chose once, whatever the number of tokens that chose
it (the experts op groups the step's tokens by expert), so the bytes it reads are, per
layer, the chosen experts' count times one expert's bytes. A dense model of the same total
size reads every expert's bytes at every step: the baseline the panel draws beside it.
"""

from collections.abc import Iterable

import numpy as np
import torch

from kvscope.engine.telemetry.records import StepRecord
from kvscope.engine.worker.models.moe import ExpertLayout

# Counts are kept as int32 bytes: a step's tokens x top_k fits one many times over.
COUNT_DTYPE = np.int32
# The recent steps the Experts panel sums (about a minute of decode at interactive rates).
WINDOW_STEPS = 256


def packed_counts(counts: torch.Tensor) -> tuple[bytes, ...]:
    """A step's tokens per expert [MoE layers, experts] as StepRecord.expert_tokens keeps
    them: one bytes object of int32 counts per layer."""
    array = counts.numpy().astype(COUNT_DTYPE)
    return tuple(row.tobytes() for row in array)


def expert_bytes(layout: ExpertLayout, counts: torch.Tensor) -> tuple[int, int]:
    """(bytes the step's chosen experts read, each once; bytes every expert holds)."""
    chosen = (counts > 0).sum(dim=1).tolist()
    read = sum(number * size for number, size in zip(chosen, layout.bytes_per_expert,
                                                      strict=True))
    return read, layout.num_experts * sum(layout.bytes_per_expert)


def step_counts(record: StepRecord) -> np.ndarray:
    """The record's tokens per expert, int64 [MoE layers, experts] ([0, 0] for a step
    without routing: a dense model's, or one that ran no forward)."""
    if not record.expert_tokens:
        return np.zeros((0, 0), dtype=np.int64)
    return np.stack([np.frombuffer(row, dtype=COUNT_DTYPE) for row in record.expert_tokens]
                    ).astype(np.int64)


def recent_counts(records: Iterable[StepRecord], steps: int = WINDOW_STEPS
                  ) -> tuple[tuple[int, ...], np.ndarray, int]:
    """The last `steps` routed steps' tokens per expert summed: (each row's decoder layer,
    int64 [MoE layers, experts], the number of steps summed). Empty for a dense model."""
    routed = [record for record in records if record.expert_tokens][-steps:]
    if not routed:
        return (), np.zeros((0, 0), dtype=np.int64), 0
    return routed[-1].expert_layers, sum(step_counts(record) for record in routed), len(routed)

