"""Export one logged session as a CSV zip, a JSON document or a standalone SQLite file.

Every format streams: rows go from the log to the file a batch at a time, so a session of
millions of steps exports in constant memory.
"""

import csv
import io
import itertools
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, insert

from kvscope.storage.models import SCHEMA_VERSION, SESSION_TABLES, SessionRow
from kvscope.storage.reader import iter_table_rows
from kvscope.storage.schema import open_database

FORMATS = ("csv", "json", "sqlite")
# Rows per INSERT into an exported SQLite file: SQLAlchemy holds a batch's parameters
# several times over while it runs, so batches stay small.
INSERT_BATCH_ROWS = 500


def export_session(engine: Engine, session_id: int, fmt: str, out_dir: str | Path) -> Path:
    """Write `kvscope-session-<id>.<zip|json|sqlite>` into out_dir and return its path."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {list(FORMATS)}")
    if not any(iter_table_rows(engine, SessionRow, session_id)):
        raise ValueError(f"session_id={session_id!r}: no such session in the log")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = {"csv": "zip", "json": "json", "sqlite": "sqlite"}[fmt]
    path = out_dir / f"kvscope-session-{session_id}.{suffix}"
    path.unlink(missing_ok=True)
    tables = {table.__tablename__: iter_table_rows(engine, table, session_id)
              for table in SESSION_TABLES}
    {"csv": _write_csv_zip, "json": _write_json, "sqlite": _write_sqlite}[fmt](tables, path)
    return path


def _write_csv_zip(tables: dict[str, Iterator[dict]], path: Path) -> None:
    """One CSV per table; JSON columns (config, chunks, outputs) hold JSON text."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, rows in tables.items():
            columns = [column.name for column in _table(name).columns]
            with archive.open(f"{name}.csv", "w") as member, io.TextIOWrapper(
                    member, encoding="utf-8", newline="") as text:
                writer = csv.DictWriter(text, fieldnames=columns)
                writer.writeheader()
                for row in rows:
                    writer.writerow({key: json.dumps(value) if isinstance(value, (dict, list))
                                     else value for key, value in row.items()})


def _write_json(tables: dict[str, Iterator[dict]], path: Path) -> None:
    """{"schema_version": N, "<table>": [rows...], ...}, one row per line."""
    with path.open("w", encoding="utf-8") as out:
        out.write(f'{{"schema_version": {SCHEMA_VERSION}')
        for name, rows in tables.items():
            out.write(f",\n{json.dumps(name)}: [")
            for index, row in enumerate(rows):
                out.write(("," if index else "") + "\n " + json.dumps(row))
            out.write("\n]")
        out.write("}\n")


def _write_sqlite(tables: dict[str, Iterator[dict]], path: Path) -> None:
    """A session log file of its own (same schema), which kvscope can open as any other."""
    engine = open_database(path)
    with engine.begin() as connection:
        for name, rows in tables.items():
            while batch := list(itertools.islice(rows, INSERT_BATCH_ROWS)):
                connection.execute(insert(_table(name)), batch)
    with engine.connect() as connection:
        # Leaving WAL mode folds the log back into the file: one self-contained file.
        connection.exec_driver_sql("PRAGMA journal_mode=DELETE")
    engine.dispose()


def _table(name: str):
    return next(table.__table__ for table in SESSION_TABLES if table.__tablename__ == name)
