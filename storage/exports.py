"""Export one logged session as a CSV zip, a JSON document or a standalone SQLite file."""

import csv
import io
import json
import zipfile
from pathlib import Path

from sqlalchemy import Engine, insert

from storage.models import SCHEMA_VERSION, SESSION_TABLES, SessionRow
from storage.reader import table_rows
from storage.schema import open_database

FORMATS = ("csv", "json", "sqlite")


def export_session(engine: Engine, session_id: int, fmt: str, out_dir: str | Path) -> Path:
    """Write `kvscope-session-<id>.<zip|json|sqlite>` into out_dir and return its path."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {list(FORMATS)}")
    tables = {table.__tablename__: table_rows(engine, table, session_id)
              for table in SESSION_TABLES}
    if not tables[SessionRow.__tablename__]:
        raise ValueError(f"session_id={session_id!r}: no such session in the log")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = {"csv": "zip", "json": "json", "sqlite": "sqlite"}[fmt]
    path = out_dir / f"kvscope-session-{session_id}.{suffix}"
    path.unlink(missing_ok=True)
    {"csv": _write_csv_zip, "json": _write_json, "sqlite": _write_sqlite}[fmt](tables, path)
    return path


def _write_csv_zip(tables: dict[str, list[dict]], path: Path) -> None:
    """One CSV per table; JSON columns (config, chunks, outputs) hold JSON text."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, rows in tables.items():
            columns = [column.name for column in _table(name).columns]
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow({key: json.dumps(value) if isinstance(value, (dict, list))
                                 else value for key, value in row.items()})
            archive.writestr(f"{name}.csv", text.getvalue())


def _write_json(tables: dict[str, list[dict]], path: Path) -> None:
    document = {"schema_version": SCHEMA_VERSION, **tables}
    path.write_text(json.dumps(document, indent=1))


def _write_sqlite(tables: dict[str, list[dict]], path: Path) -> None:
    """A session log file of its own (same schema), which kvscope can open as any other."""
    engine = open_database(path)
    with engine.begin() as connection:
        for name, rows in tables.items():
            if rows:
                connection.execute(insert(_table(name)), rows)
    with engine.connect() as connection:
        # Leaving WAL mode folds the log back into the file: one self-contained file.
        connection.exec_driver_sql("PRAGMA journal_mode=DELETE")
    engine.dispose()


def _table(name: str):
    return next(table.__table__ for table in SESSION_TABLES if table.__tablename__ == name)
