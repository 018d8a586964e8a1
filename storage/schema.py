"""Opening a log file: SQLite pragmas, table creation and the schema upgrade path."""

import logging
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, inspect, select

from kvscope.storage.models import (
    SCHEMA_VERSION,
    Base,
    PoolRecordRow,
    RoutingDecisionRow,
    SchemaVersion,
)

logger = logging.getLogger(__name__)
BUSY_TIMEOUT_MS = 5000

# Version 2 added the per-step cache statistics of StepRecord to the steps table.
STEP_COLUMNS_OF_VERSION_2 = ("prefix_cache_queries", "prefix_cache_hits",
                             "num_blocks_swapped_out", "num_blocks_swapped_in")


def _add_step_statistics(connection: Connection) -> None:
    for column in STEP_COLUMNS_OF_VERSION_2:
        connection.exec_driver_sql(
            f"ALTER TABLE steps ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")


def _add_replica_columns(connection: Connection) -> None:
    """Version 3: requests and steps record the engine replica (0 for a single engine)."""
    for table in ("requests", "steps"):
        connection.exec_driver_sql(
            f"ALTER TABLE {table} ADD COLUMN replica INTEGER NOT NULL DEFAULT 0")


def _add_routing_decisions(connection: Connection) -> None:
    """Version 4: the router's decision for every request (empty for a single engine)."""
    RoutingDecisionRow.__table__.create(connection)


# Version 5 added what a replay needs to the requests table.
REQUEST_COLUMNS_OF_VERSION_5 = (("prompt_token_ids", "JSON"), ("output_token_ids", "JSON"),
                                ("sampling_params", "JSON"), ("arrival_offset_s", "FLOAT"))


def _add_replay_columns(connection: Connection) -> None:
    """Version 5: older requests read back with NULLs (a replay re-tokenizes their prompt
    text and takes default sampling)."""
    for column, sql_type in REQUEST_COLUMNS_OF_VERSION_5:
        connection.exec_driver_sql(f"ALTER TABLE requests ADD COLUMN {column} {sql_type}")


def _add_spec_drafts(connection: Connection) -> None:
    """Version 6: each step's verified speculative proposals (empty before)."""
    connection.exec_driver_sql("ALTER TABLE steps ADD COLUMN spec_drafts JSON NOT NULL "
                               "DEFAULT '[]'")


def _add_pool_records(connection: Connection) -> None:
    """Version 7: the pool's records, for stepping through a saved session's pool (older
    sessions have none)."""
    PoolRecordRow.__table__.create(connection)


def _add_expert_columns(connection: Connection) -> None:
    """Version 8: each step's mixture-of-experts routing (empty before, as for a dense
    model)."""
    for column in ("expert_layers", "expert_tokens"):
        connection.exec_driver_sql(f"ALTER TABLE steps ADD COLUMN {column} JSON NOT NULL "
                                   "DEFAULT '[]'")
    for column in ("expert_bytes_read", "expert_bytes_all"):
        connection.exec_driver_sql(f"ALTER TABLE steps ADD COLUMN {column} INTEGER NOT NULL "
                                   "DEFAULT 0")


def _add_preemption_causes(connection: Connection) -> None:
    """Version 9: why each preemption happened (empty before: the causes were not kept)."""
    connection.exec_driver_sql("ALTER TABLE steps ADD COLUMN preemptions JSON NOT NULL "
                               "DEFAULT '[]'")


def _add_prefix_misses(connection: Connection) -> None:
    """Version 10: why admissions missed cached tokens (empty before: not kept)."""
    connection.exec_driver_sql("ALTER TABLE steps ADD COLUMN prefix_misses JSON NOT NULL "
                               "DEFAULT '[]'")


# Version 11 added the disk tier per step to the steps table.
STEP_COLUMNS_OF_VERSION_11 = ("tier_blocks_held", "tier_bytes_held", "tier_blocks_stored",
                              "tier_blocks_removed", "tier_blocks_loaded", "tier_bytes_loaded",
                              "tier_loads", "tier_query_tokens", "tier_hit_tokens")


def _add_tier_columns(connection: Connection) -> None:
    """Version 11: the disk tier per step (NULL before: not kept)."""
    for column in STEP_COLUMNS_OF_VERSION_11:
        connection.exec_driver_sql(f"ALTER TABLE steps ADD COLUMN {column} INTEGER")


# MIGRATIONS[v] upgrades a version-v file to v + 1 inside one transaction.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _add_step_statistics, 2: _add_replica_columns, 3: _add_routing_decisions,
    4: _add_replay_columns, 5: _add_spec_drafts, 6: _add_pool_records,
    7: _add_expert_columns, 8: _add_preemption_causes, 9: _add_prefix_misses,
    10: _add_tier_columns}


def open_database(path: str | Path) -> Engine:
    """An Engine on the file in WAL mode, its schema created or upgraded to SCHEMA_VERSION."""
    engine = create_engine(f"sqlite:///{Path(path)}")
    event.listen(engine, "connect", _set_pragmas)
    with engine.begin() as connection:
        upgrade(connection)
    return engine


def _set_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the dashboard read while the writer commits, and a second app on the file
    # waits on the busy timeout instead of failing; NORMAL sync is durable against a
    # killed process (only an OS crash can lose the last commits).
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def upgrade(connection: Connection) -> None:
    """Create a fresh schema, or step an older one up to SCHEMA_VERSION."""
    if not inspect(connection).has_table(SchemaVersion.__tablename__):
        Base.metadata.create_all(connection)
        connection.execute(SchemaVersion.__table__.insert().values(version=SCHEMA_VERSION))
        return
    version = connection.execute(select(SchemaVersion.version)).scalar_one()
    if version > SCHEMA_VERSION:
        raise ValueError(f"the session log was written by a newer kvscope (schema version "
                         f"{version}, this one reads up to {SCHEMA_VERSION})")
    for step_from in range(version, SCHEMA_VERSION):
        logger.info("upgrading the session log schema from version %d", step_from)
        MIGRATIONS[step_from](connection)
    if version != SCHEMA_VERSION:
        connection.execute(SchemaVersion.__table__.update().values(version=SCHEMA_VERSION))
    # New tables of later versions (never changed ones) are created here.
    Base.metadata.create_all(connection)
