"""Read side of the session log: the sessions list and one session's rows."""

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Engine, func, select

from kvscope.engine.telemetry.pool_history import PoolHistory, history_of
from kvscope.engine.telemetry.pool_messages import RecordReader
from kvscope.engine.telemetry.records import StepRecord
from kvscope.storage.models import (
    ChatMessageRow,
    ConfigRow,
    PoolRecordRow,
    RequestRow,
    RoutingDecisionRow,
    SessionRow,
    StepRow,
)
from kvscope.storage.rows import step_record

ROWS_PER_FETCH = 2000
# What an SQLite INTEGER holds; an id outside it names no row (and SQLite would refuse it).
SQLITE_INTEGERS = range(-(2 ** 63), 2 ** 63)


@dataclass(slots=True)
class StoredSession:
    session: dict
    requests: list[dict]
    steps: list[StepRecord]
    chat_messages: list[dict]
    configs: list[dict]  # {"applied_at", "config"}, oldest first
    routing_decisions: list[dict]  # a ReplicaSet's, one per routed request


def list_sessions(engine: Engine) -> list[dict]:
    """Every session, newest first, with its request / step / chat message counts and the
    block sizes it ran (block_size, steps run with it), the most steps first."""
    counts = {table: dict(_counts(engine, table))
              for table in (RequestRow, StepRow, ChatMessageRow)}
    block_sizes = _block_sizes(engine)
    with engine.connect() as connection:
        sessions = connection.execute(select(SessionRow).order_by(SessionRow.id.desc()))
        return [{**row._asdict(), "num_requests": counts[RequestRow].get(row.id, 0),
                 "num_steps": counts[StepRow].get(row.id, 0),
                 "num_chat_messages": counts[ChatMessageRow].get(row.id, 0),
                 "block_sizes": block_sizes.get(row.id, [])}
                for row in sessions]


# Steps per block size: each config holds from its applied_at until the next one's.
BLOCK_SIZE_STEPS = """
WITH spans AS (
    SELECT session_id, id, applied_at, json_extract(config, '$.block_size') AS block_size,
           LEAD(applied_at) OVER (PARTITION BY session_id ORDER BY applied_at, id) AS until
    FROM session_configs)
SELECT spans.session_id, spans.block_size, COUNT(steps.id), MIN(spans.id)
FROM spans LEFT JOIN steps ON steps.session_id = spans.session_id
    AND steps.start_time >= spans.applied_at
    AND (spans.until IS NULL OR steps.start_time < spans.until)
GROUP BY spans.session_id, spans.block_size
"""


def _block_sizes(engine: Engine) -> dict[int, list[tuple[int, int]]]:
    """Per session, (block_size, steps run with it), the most steps first (ties: the one
    applied first)."""
    with engine.connect() as connection:
        rows = connection.exec_driver_sql(BLOCK_SIZE_STEPS).all()
    sizes: dict[int, list] = {}
    for session_id, block_size, num_steps, first in sorted(rows, key=lambda r: (-r[2], r[3])):
        if block_size is not None:
            sizes.setdefault(session_id, []).append((block_size, num_steps))
    return sizes


def _counts(engine: Engine, table) -> list[tuple[int, int]]:
    with engine.connect() as connection:
        return list(connection.execute(
            select(table.session_id, func.count()).group_by(table.session_id)))


def table_rows(engine: Engine, table, session_id: int) -> list[dict]:
    """One session's rows of a table, in insertion order, as plain dicts."""
    return list(iter_table_rows(engine, table, session_id))


def iter_table_rows(engine: Engine, table, session_id: int) -> Iterator[dict]:
    """The same rows, fetched ROWS_PER_FETCH at a time: a long session is never all in
    memory at once."""
    if session_id not in SQLITE_INTEGERS:
        return
    key = table.id if table is SessionRow else table.session_id
    with engine.connect() as connection:
        result = connection.execution_options(yield_per=ROWS_PER_FETCH).execute(
            select(table.__table__).where(key == session_id).order_by(table.id))
        for row in result:
            yield dict(row._mapping)


def load_session(engine: Engine, session_id: int) -> StoredSession:
    """Everything logged for one session; ValueError naming the id if there is none."""
    sessions = table_rows(engine, SessionRow, session_id)
    if not sessions:
        raise ValueError(f"session_id={session_id!r}: no such session in the log")
    steps = [step_record(row) for row in table_rows(engine, StepRow, session_id)]
    configs = [{"applied_at": row["applied_at"], "config": row["config"]}
               for row in table_rows(engine, ConfigRow, session_id)]
    return StoredSession(sessions[0], table_rows(engine, RequestRow, session_id), steps,
                         table_rows(engine, ChatMessageRow, session_id), configs,
                         table_rows(engine, RoutingDecisionRow, session_id))


def count_pool_records(engine: Engine, session_id: int) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(PoolRecordRow).where(
            PoolRecordRow.session_id == session_id)).scalar_one()


def pool_history(engine: Engine, session_id: int, replica: int = 0) -> PoolHistory:
    """The session's pool, frame by frame (engine.telemetry.pool_history.PoolHistory), from
    its pool records; an empty history for a session logged without them."""
    messages = RecordReader()
    return history_of(record for row in iter_table_rows(engine, PoolRecordRow, session_id)
                      if row["replica"] == replica
                      for record in messages.records_of(row["payload"]))
