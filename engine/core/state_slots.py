"""State slots: the recurrent layers' cache beside the paged blocks.

A recurrent layer (LFM2's short convolution, Qwen3.5's Gated DeltaNet) keeps one
fixed-size state per sequence instead of K/V that grows with the context. Every recurrent
layer of the model keeps that state at the same slot index of its own state tensors
(ModelRunner.allocate_state_slots), so one slot number per sequence names all of them.
This is vLLM's Mamba group beside the attention groups of its hybrid KV cache manager.

With prefix caching, the slots no running sequence holds keep snapshots: the state after
a cached prefix, keyed by the hash of the prefix's last block (vLLM's way: taken where a
prefill chunk ends on a block boundary, KVCacheManager.cache_full_blocks). A prefix hit
restores one into the new sequence's slot. Snapshots are a cache: a sequence that needs a
slot evicts the least recently used one.

Invariants (docs/architecture.md, "State slots"): a slot belongs to at most one live
sequence or one snapshot; a sequence holds a slot exactly while it holds device blocks
(taken with its first blocks at admission, given back at finish, abort and preemption); a
forked child gets a slot of its own whose state is a copy of its parent's at the fork; no
two copies owed write one slot.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.request import BlockHash, Sequence

logger = logging.getLogger(__name__)


def recurrent_model_config(config: EngineConfig, architecture: str) -> EngineConfig:
    """The config a model with recurrent layers runs under, each change logged with why.

    Speculative decoding is refused: a rejected proposal's tokens are already folded into
    the state, which keeps no earlier copy to roll back to. Swap preemption becomes
    recompute: the swap pool holds blocks, not slots; a recompute rebuilds the state by
    prefilling again. (Prefix caching works through snapshots, see StateSlots.)
    """
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config: {architecture} has recurrent layers, whose "
                         "state cannot be rolled back past rejected proposals; speculative "
                         "decoding supports attention-only models (speculative_config=None)")
    if config.preemption_mode != "swap":
        return config
    logger.warning("preemption_mode='swap': %s preempts by recompute instead (its "
                   "recurrent layers' state slots are not swapped; a recompute rebuilds "
                   "them)", architecture)
    return replace(config, preemption_mode="recompute")


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """Copy slot `source`'s state into slot `target` before the next forward (a fork)."""

    source: int
    target: int


class StateSlots:
    """The free slots, who holds the others, the snapshots, and the state copies owed."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots: at least 1 for a model with recurrent layers, "
                             f"got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.owners: dict[int, Sequence] = {}
        # Prefix (its last block's hash) -> the slot keeping the state after it, least
        # recently used first.
        self.snapshots: OrderedDict[BlockHash, int] = OrderedDict()
        self._pending_copies: list[SlotCopy] = []

    @property
    def num_free(self) -> int:
        """Slots a sequence can take: the free ones and the snapshots' (evictable)."""
        return len(self._free) + len(self.snapshots)

    def _pop_free(self) -> int:
        """A free slot, else the least recently used snapshot's (forgetting it)."""
        if self._free:
            return self._free.pop()
        _, slot = self.snapshots.popitem(last=False)
        self._pending_copies = [c for c in self._pending_copies if c.target != slot]
        return slot

    def _content_source(self, slot: int) -> int:
        """The slot whose present state `slot` holds once the copies owed are made (a
        snapshot may still be owed its copy)."""
        return next((c.source for c in self._pending_copies if c.target == slot), slot)

    def take(self, seq: Sequence) -> None:
        """Give the sequence a slot (evicting a snapshot if none is free); its state there
        is reset by its first chunk (a chunk from position 0 starts from a zero state)."""
        if seq.state_slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {seq.state_slot}")
        slot = self._pop_free()
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
        if parent.state_slot is None or not self.num_free:
            return False
        self._copy_into_new_slot(self._content_source(parent.state_slot), child)
        return True

    def _copy_into_new_slot(self, source: int, seq: Sequence) -> None:
        self.take(seq)
        if seq.state_slot != source:  # else the evicted snapshot's slot is the sequence's
            self._pending_copies.append(SlotCopy(source, seq.state_slot))

    def snapshot(self, seq: Sequence, prefix: BlockHash) -> None:
        """Keep the state of the sequence's slot (that after `prefix`, its last block's
        hash) in a slot of its own; nothing if every slot is held by a sequence."""
        if prefix in self.snapshots:
            self.snapshots.move_to_end(prefix)
            return
        if not self.num_free:
            return
        source = self._content_source(seq.state_slot)
        slot = self._pop_free()
        self.snapshots[prefix] = slot
        self._pending_copies.append(SlotCopy(source, slot))

    def restore(self, seq: Sequence, prefix: BlockHash) -> None:
        """Give the sequence a slot holding the snapshot of `prefix` (which must exist)."""
        self.snapshots.move_to_end(prefix)
        self._copy_into_new_slot(self._content_source(self.snapshots[prefix]), seq)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, target) copies owed since the last call, for the device to do
        before its next forward."""
        copies = [(c.source, c.target) for c in self._pending_copies]
        self._pending_copies = []
        return copies

    def table(self) -> "SlotTable":
        """Who holds each slot now (the dashboard's slot table, engine.orchestrator's
        AsyncEngine.state_slot_table)."""
        return SlotTable(
            self.num_slots,
            tuple((slot, seq.request.request_id, seq.seq_id)
                  for slot, seq in sorted(self.owners.items())),
            tuple(sorted((slot, prefix[0].hex()) for prefix, slot in self.snapshots.items())))


@dataclass(frozen=True, slots=True)
class SlotTable:
    """The state slots at one instant: the ones running sequences hold, and the ones
    keeping prefix snapshots (the rest are free)."""

    num_slots: int
    held: tuple[tuple[int, str, str], ...]  # (slot, request id, sequence id), by slot
    # (slot, the hex hash of the snapshot's prefix's last block: BlockInfo.block_hash's
    # form, so a pool view can find that block), by slot
    snapshots: tuple[tuple[int, str], ...]

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.held) - len(self.snapshots)
