"""What changed in the KV cache since readers last looked: touched blocks and block tables.

The pool and the cache manager note every change here as it happens (a dict insert);
`engine.telemetry.take_pool_delta` turns the notes into one PoolDelta per step. The cost
is O(blocks and sequences touched), never O(pool), so watching a million-block pool costs
the engine what watching a thousand-block one does.
"""

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.engine.core.block_pool import KVBlock
    from kvscope.engine.core.request import Sequence

_epochs = itertools.count()


class BlockEventLog:
    """Written on the engine thread only; drained by take_pool_delta."""

    def __init__(self) -> None:
        # One per pool: a reconfigure builds a new pool, and readers must start over.
        self.epoch = next(_epochs)
        self.num_deltas = 0  # deltas taken so far; readers spot a missed one by the gap
        self.blocks: dict[int, "KVBlock"] = {}  # block id -> block, in order of first touch
        self.sequences: dict[str, "Sequence"] = {}  # whose block table changed (or ended)
        self.table_from: dict[str, int] = {}  # lowest block-table index changed
        # What readers were last told about each live sequence:
        # (status, num_tokens, num_computed_tokens, len(block_table)).
        self.sent: dict[str, tuple] = {}
        self.config: dict | None = None  # the engine config as a dict, made once

    def table_changed(self, seq: "Sequence", from_index: int) -> None:
        """seq.block_table[from_index:] is (or is about to be) new; earlier entries stay."""
        seq_id = seq.seq_id
        self.sequences[seq_id] = seq
        previous = self.table_from.get(seq_id)
        if previous is None or from_index < previous:
            self.table_from[seq_id] = from_index

    def sequence_changed(self, seq: "Sequence") -> None:
        """A sequence entered or left the scheduler's queues without a table change."""
        self.sequences[seq.seq_id] = seq

    @property
    def pending(self) -> bool:
        return bool(self.blocks or self.sequences)
