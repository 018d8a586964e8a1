"""The SQLite session log: sessions, requests, steps, routing decisions and chat messages,
with exports, and the recorder that fills it from an engine's feeds."""

from kvscope.storage.exports import FORMATS, export_session
from kvscope.storage.models import SCHEMA_VERSION
from kvscope.storage.reader import StoredSession, list_sessions, load_session
from kvscope.storage.recorder import record_sessions
from kvscope.storage.schema import open_database
from kvscope.storage.session_log import SessionLog

__all__ = ["FORMATS", "SCHEMA_VERSION", "SessionLog", "StoredSession", "export_session",
           "list_sessions", "load_session", "open_database", "record_sessions"]
