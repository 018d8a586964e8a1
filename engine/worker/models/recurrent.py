"""Recurrent layers: a fixed-size state per sequence, kept in the sequence's state slot.

LFM2's short convolutions and Qwen3.5's Gated DeltaNet layers cache no K/V; each keeps a
state per sequence (the last conv-width - 1 inputs, the delta rule's matrix) at the
sequence's slot of its own state tensors (engine.core.state_slots), which the model runner
allocates for every layer at once (ModelRunner.allocate_state_slots). A forward's chunks
are read per sequence: a prefill chunk runs its tokens through the state one sequence at a
time, the one-token chunks of decoding sequences run as one batch.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.engine.worker.models.bound_ops import UsesKernelOps


@dataclass(slots=True)
class StateMetadata:
    """Where each sequence of a forward keeps its state, and which rows are its tokens."""

    # Rows of the one-token chunks (decodes) and their slots: a slice of every row where
    # the whole forward decodes, else an int64 index.
    decode_rows: slice | torch.Tensor
    decode_slots: torch.Tensor  # int64 [decoding sequences]
    # (first row, end row, slot) of each chunk of two tokens or more, in batch order.
    prefills: list[tuple[int, int, int]]

    @classmethod
    def build(cls, row_starts: list[int], slots: list[int],
              device: torch.device) -> "StateMetadata":
        """From the batch's chunk boundaries (query_start_loc, num_seqs + 1 entries) and
        each sequence's slot."""
        decode_rows, decode_slots, prefills = [], [], []
        for start, end, slot in zip(row_starts, row_starts[1:], slots):
            if end - start == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
            else:
                prefills.append((start, end, slot))
        rows = (slice(None) if not prefills
                else torch.tensor(decode_rows, dtype=torch.int64, device=device))
        return cls(rows, torch.tensor(decode_slots, dtype=torch.int64, device=device), prefills)

    @property
    def num_decodes(self) -> int:
        return self.decode_slots.numel()


def by_sequence(state: StateMetadata, out: torch.Tensor,
                prefill: Callable[[int, int, int], torch.Tensor],
                decode: Callable[[slice | torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
    """Fill `out` ([rows, ...]) chunk by chunk: prefill(first row, end row, slot) for each
    chunk of two tokens or more, decode(rows, slots) once for all one-token chunks."""
    if state.num_decodes:
        out[state.decode_rows] = decode(state.decode_rows, state.decode_slots)
    for start, end, slot in state.prefills:
        out[start:end] = prefill(start, end, slot)
    return out


class RecurrentLayer(UsesKernelOps):
    """A layer whose cache is one state per sequence: `state_shapes` says what one slot
    holds, the runner puts the tensors ([num_slots, *shape] each) in `states`."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def slot_bytes(self) -> int:
        """What one slot of this layer's states takes."""
        return sum(torch.Size(shape).numel() * dtype.itemsize
                   for shape, dtype in self.state_shapes().values())
