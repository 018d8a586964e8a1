"""Pool records (PoolBase, PoolSlice, PoolDelta) <-> the JSON rows of the pool_records table.

A saved session keeps the pool's records as a live reader received them, so the
Sessions tab can step through the pool as the Live tab does (engine.telemetry.
pool_history). Block hashes go out as hex; the config, the same dict for a pool's whole
life, only with the first record of each pool (epoch) and is filled in on the way back.
"""

from kvscope.engine.telemetry.records import PoolBase, PoolCounters, PoolDelta, PoolSlice

COUNTER_FIELDS = ("step", "time", "num_blocks", "block_size", "num_running", "num_waiting",
                  "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                  "num_evictions")
KINDS = {PoolBase: "base", PoolSlice: "slice", PoolDelta: "delta"}


def _hash_out(block_hash) -> list | None:
    if block_hash is None:
        return None
    value, parent, token_ids = block_hash
    return [value.hex(), parent.hex() if parent is not None else None, list(token_ids)]


def _hash_in(cell) -> tuple | None:
    if cell is None:
        return None
    value, parent, token_ids = cell
    return (bytes.fromhex(value), bytes.fromhex(parent) if parent is not None else None,
            tuple(token_ids))


def _pairs(cells) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in cells)


class PoolRowWriter:
    """Encodes one feed's records in order (it remembers which pools' configs it wrote)."""

    def __init__(self) -> None:
        self._epochs_written: set[int] = set()

    def row(self, session_id: int, replica: int, record) -> dict:
        kind = KINDS[type(record)]
        payload: dict = {"epoch": record.epoch}
        if kind == "slice":
            payload |= {"start": record.start, "ref_counts": list(record.ref_counts),
                        "hashes": [[block_id, _hash_out(value)]
                                   for block_id, value in record.hashes],
                        "hits": [list(pair) for pair in record.hits]}
        else:
            counters = record.counters
            payload |= {"index": record.index,
                        "counters": [getattr(counters, name) for name in COUNTER_FIELDS],
                        "sequences": [list(change) for change in record.sequences]}
            if record.epoch not in self._epochs_written:
                self._epochs_written.add(record.epoch)
                payload["config"] = counters.config
            if kind == "base":
                payload["free_order"] = list(record.free_order)
            else:
                payload |= {"blocks": [[block_id, ref_count, _hash_out(value)]
                                       for block_id, ref_count, value in record.blocks],
                            "removed": list(record.removed), "freed": list(record.freed),
                            "hits": [list(pair) for pair in record.hits]}
        return {"session_id": session_id, "replica": replica, "kind": kind,
                "payload": payload}


def pool_records(rows):
    """The records of stored rows, in order (the rows of one replica's feed)."""
    configs: dict[int, dict] = {}
    for row in rows:
        payload, kind = row["payload"], row["kind"]
        epoch = payload["epoch"]
        if kind == "slice":
            yield PoolSlice(epoch, payload["start"], tuple(payload["ref_counts"]),
                            tuple((block_id, _hash_in(value))
                                  for block_id, value in payload["hashes"]),
                            _pairs(payload["hits"]))
            continue
        config = configs.setdefault(epoch, payload.get("config") or {})
        counters = PoolCounters(*payload["counters"], config)
        sequences = tuple(tuple(tuple(cell) if isinstance(cell, list) else cell
                                for cell in change) for change in payload["sequences"])
        if kind == "base":
            yield PoolBase(epoch, payload["index"], counters, sequences,
                           tuple(payload["free_order"]))
        else:
            yield PoolDelta(epoch, payload["index"], counters, tuple(
                (block_id, ref_count, _hash_in(value))
                for block_id, ref_count, value in payload["blocks"]), sequences,
                tuple(payload["removed"]), tuple(payload["freed"]), _pairs(payload["hits"]))
