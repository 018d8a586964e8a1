"""The pool's telemetry records as /ws/events JSON: what a client needs to keep its own
mirror of the pool (kvscope.engine.telemetry.pool_mirror does the same in Python).

- {"type": "pool_base", ...}: start over: the live sequences and the scalars; the blocks
  follow in "pool_slice" messages, between the deltas.
- {"type": "pool_slice", "start", "ref_counts", "hashes"}: blocks [start, start + n) as
  they are now; hashes lists [block id, [hash hex, parent hex or null, token ids]].
- {"type": "pool", "deltas": [...]}: per step, the touched blocks [id, ref count, hash or
  null] and the changed sequences (table[table_from:] = table_tail, token_ids[token_from:]
  = new_token_ids); a delta whose epoch or index does not follow means "wait for the
  next pool_base" (the server sends one when a client falls behind).
"""

import dataclasses

from kvscope.engine.core.block_pool import BlockHash
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolDelta, PoolSlice, SequenceChange


def _hash(block_hash: BlockHash | None) -> list | None:
    if block_hash is None:
        return None
    value, parent, token_ids = block_hash
    return [value.hex(), parent.hex() if parent else None, list(token_ids)]


def _counters(counters: PoolCounters, with_config: bool) -> dict:
    fields = dataclasses.asdict(counters)
    if not with_config:  # the same dict for a pool's whole life: sent with the base only
        del fields["config"]
    return fields


def delta_dict(delta: PoolDelta) -> dict:
    return {"epoch": delta.epoch, "index": delta.index,
            "counters": _counters(delta.counters, with_config=delta.index == 0),
            "blocks": [[block_id, ref_count, _hash(block_hash)]
                       for block_id, ref_count, block_hash in delta.blocks],
            "sequences": [SequenceChange._make(change)._asdict() for change in delta.sequences],
            "removed": list(delta.removed)}


def pool_messages(records: list) -> list[dict]:
    """Messages for a batch of pool records, in order; consecutive deltas go out as one."""
    messages: list[dict] = []
    for record in records:
        if isinstance(record, PoolDelta):
            if not messages or messages[-1]["type"] != "pool":
                messages.append({"type": "pool", "deltas": []})
            messages[-1]["deltas"].append(delta_dict(record))
        elif isinstance(record, PoolBase):
            messages.append({"type": "pool_base", "epoch": record.epoch, "index": record.index,
                             "counters": _counters(record.counters, with_config=True),
                             "sequences": [SequenceChange._make(change)._asdict()
                                           for change in record.sequences]})
        elif isinstance(record, PoolSlice):
            messages.append({"type": "pool_slice", "epoch": record.epoch,
                             "start": record.start, "ref_counts": list(record.ref_counts),
                             "hashes": [[block_id, _hash(block_hash)]
                                        for block_id, block_hash in record.hashes]})
    return messages
