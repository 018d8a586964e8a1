"""State slots: the recurrent layers' cache beside the paged blocks.

A recurrent layer (LFM2's short convolution, Qwen3.5's Gated DeltaNet) keeps one
fixed-size state per sequence instead of K/V that grows with the context. Every recurrent
layer of the model keeps that state at the same slot index of its own state tensors
(ModelRunner.allocate_state_slots), so one slot number per sequence names all of them.
This is vLLM's Mamba group beside the attention groups of its hybrid KV cache manager.

Invariants (docs/architecture.md, "State slots"): a slot belongs to at most one live
sequence; a sequence holds a slot exactly while it holds device blocks (taken with its
first blocks at admission, given back at finish, abort and preemption); a forked child
gets a slot of its own whose state is a copy of its parent's at the fork.
"""

import logging
from dataclasses import dataclass, replace

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.request import Sequence

logger = logging.getLogger(__name__)


def recurrent_model_config(config: EngineConfig, architecture: str) -> EngineConfig:
    """The config a model with recurrent layers runs under, each change logged with why.

    Speculative decoding is refused: a rejected proposal's tokens are already folded into
    the state, which keeps no earlier copy to roll back to. Prefix caching is turned off:
    a cached block holds K/V, not the recurrent state at its end, so a hit would skip the
    recurrence over the prefix. Swap preemption becomes recompute: the swap pool holds
    blocks, not slots; a recompute rebuilds the state by prefilling again.
    """
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config: {architecture} has recurrent layers, whose "
                         "state cannot be rolled back past rejected proposals; speculative "
                         "decoding supports attention-only models (speculative_config=None)")
    changes = {}
    if config.enable_prefix_caching:
        changes["enable_prefix_caching"] = False
        logger.warning("enable_prefix_caching=True: turned off for %s, whose recurrent "
                       "layers' state at a cached block's end is not kept (a hit would skip "
                       "their recurrence over the prefix)", architecture)
    if config.preemption_mode == "swap":
        changes["preemption_mode"] = "recompute"
        logger.warning("preemption_mode='swap': %s preempts by recompute instead (its "
                       "recurrent layers' state slots are not swapped; a recompute rebuilds "
                       "them)", architecture)
    return replace(config, **changes) if changes else config


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """Copy slot `source`'s state into slot `target` before the next forward (a fork)."""

    source: int
    target: int


class StateSlots:
    """The free slots and who holds the others; the state copies a fork still owes."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots: at least 1 for a model with recurrent layers, "
                             f"got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.owners: dict[int, Sequence] = {}
        self._pending_copies: list[SlotCopy] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq: Sequence) -> None:
        """Give the sequence a free slot; its state there is reset by its first chunk (a
        chunk from position 0 starts from a zero state)."""
        if seq.state_slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {seq.state_slot}")
        slot = self._free.pop()
        self.owners[slot] = seq
        seq.state_slot = slot

    def release(self, seq: Sequence) -> None:
        """Give the sequence's slot back (nothing if it holds none)."""
        slot = seq.state_slot
        if slot is None:
            return
        del self.owners[slot]
        self._free.append(slot)
        seq.state_slot = None
        # A copy into the freed slot is moot; one out of it still runs before any forward
        # writes the slot again (copies run first), so it stays.
        self._pending_copies = [c for c in self._pending_copies if c.target != slot]

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """A slot for the child holding a copy of the parent's state; False if none is
        free (the child then recomputes its tokens)."""
        if parent.state_slot is None or not self._free:
            return False
        self.take(child)
        self._pending_copies.append(SlotCopy(parent.state_slot, child.state_slot))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, target) copies owed since the last call, for the device to do
        before its next forward."""
        copies = [(c.source, c.target) for c in self._pending_copies]
        self._pending_copies = []
        return copies

    def table(self) -> dict[int, str]:
        """Slot -> the id of the sequence holding it (the dashboard's slot table)."""
        return {slot: seq.seq_id for slot, seq in sorted(self.owners.items())}
