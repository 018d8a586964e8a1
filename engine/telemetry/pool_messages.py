"""The pool's telemetry records as JSON: /ws/events sends them, and the session log keeps
them (storage: pool_records) for stepping through a saved session's pool. What a client
needs to keep its own mirror of the pool (kvscope.engine.telemetry.pool_mirror does the
same in Python); `records_of` reads a message back.

- {"type": "pool_base", ...}: start over: the live sequences, the scalars and the
  cached-free blocks in eviction order (free_order, the next evicted first); the blocks
  follow in "pool_slice" messages, between the deltas.
- {"type": "pool_slice", "start", "ref_counts", "hashes", "hits"}: blocks [start, start +
  n) as they are now; hashes lists [block id, [hash hex, parent hex or null, token ids]],
  hits [block id, prefix-cache hits] where any.
- {"type": "pool", "deltas": [...]}: per step, the touched blocks [id, ref count, hash or
  null], their hits, the blocks that joined the back of the eviction order (freed, in
  order) and the changed sequences (table[table_from:] = table_tail,
  token_ids[token_from:] = new_token_ids); a delta whose epoch or index does not follow
  means "wait for the next pool_base" (the server sends one when a client falls behind).

The config, the same dict for a pool's whole life, comes with the records that start a
pool (a base, a delta 0) only.
"""

import dataclasses

from kvscope.engine.core.request import BlockHash
from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolDelta, PoolSlice, SequenceChange


def _hash(block_hash: BlockHash | None) -> list | None:
    if block_hash is None:
        return None
    value, parent, token_ids = block_hash
    return [value.hex(), parent.hex() if parent else None, list(token_ids)]


def _hash_of(cell: list | None) -> BlockHash | None:
    if cell is None:
        return None
    value, parent, token_ids = cell
    return bytes.fromhex(value), bytes.fromhex(parent) if parent else None, tuple(token_ids)


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
            "removed": list(delta.removed), "freed": list(delta.freed),
            "hits": [list(pair) for pair in delta.hits]}


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
                                           for change in record.sequences],
                             "free_order": list(record.free_order)})
        elif isinstance(record, PoolSlice):
            messages.append({"type": "pool_slice", "epoch": record.epoch,
                             "start": record.start, "ref_counts": list(record.ref_counts),
                             "hashes": [[block_id, _hash(block_hash)]
                                        for block_id, block_hash in record.hashes],
                             "hits": [list(pair) for pair in record.hits]})
    return messages


class RecordReader:
    """Reads messages back into records, in order (it remembers each pool's config)."""

    def __init__(self) -> None:
        self._configs: dict[int, dict] = {}

    def records_of(self, message: dict) -> list:
        kind = message["type"]
        if kind == "pool":
            return [self._delta(delta) for delta in message["deltas"]]
        if kind == "pool_slice":
            return [PoolSlice(message["epoch"], message["start"], tuple(message["ref_counts"]),
                              tuple((block_id, _hash_of(cell))
                                    for block_id, cell in message["hashes"]),
                              _pairs(message["hits"]))]
        return [PoolBase(message["epoch"], message["index"],
                         self._counters(message["epoch"], message["counters"]),
                         _sequences(message["sequences"]), tuple(message["free_order"]))]

    def _delta(self, delta: dict) -> PoolDelta:
        return PoolDelta(delta["epoch"], delta["index"],
                         self._counters(delta["epoch"], delta["counters"]),
                         tuple((block_id, ref_count, _hash_of(cell))
                               for block_id, ref_count, cell in delta["blocks"]),
                         _sequences(delta["sequences"]), tuple(delta["removed"]),
                         tuple(delta["freed"]), _pairs(delta["hits"]))

    def _counters(self, epoch: int, fields: dict) -> PoolCounters:
        config = fields.get("config")
        if config is not None:
            self._configs[epoch] = config
        return PoolCounters(**{**fields, "config": self._configs.get(epoch, {})})


def _sequences(changes: list[dict]) -> tuple[tuple, ...]:
    return tuple(tuple(SequenceChange(**{**change, "table_tail": tuple(change["table_tail"]),
                                         "new_token_ids": tuple(change["new_token_ids"])}))
                 for change in changes)


def _pairs(cells: list) -> tuple[tuple[int, int], ...]:
    return tuple((block_id, count) for block_id, count in cells)
