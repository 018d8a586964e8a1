"""A session of kvscope's own SQLite log as a workload: the requests as they arrived, the
config they ran under and the steps they took (a step-cost model fits to those)."""

from pathlib import Path

from kvscope.engine.replay.workload import ReplayRequest, Workload
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path
from kvscope.storage.reader import list_sessions, load_session
from kvscope.storage.schema import open_database

LOG_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def is_session_log(path: Path) -> bool:
    return path.suffix.lower() in LOG_SUFFIXES


def load_session_workload(path: str | Path, session_id: int | None = None,
                          model: str | None = None) -> Workload:
    """Session `session_id` of the log (default: the latest with requests). Requests logged
    before schema version 5 kept no token ids or sampling: their prompt text is tokenized
    again (by `model`'s tokenizer, default the recorded model's) and they sample with the
    defaults."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such session log")
    engine = open_database(path)
    try:
        if session_id is None:
            with_requests = [s["id"] for s in list_sessions(engine) if s["num_requests"]]
            if not with_requests:
                raise ValueError(f"{path}: no session with requests in the log")
            session_id = with_requests[0]
        stored = load_session(engine, session_id)
    finally:
        engine.dispose()
    started = stored.session["started_at"]
    config = stored.configs[0]["config"] if stored.configs else stored.session["config"]
    rows = [row for row in stored.requests
            if row["num_output_tokens"] > 0 and row["error"] is None]
    if not rows:
        raise ValueError(f"{path}: session {session_id} has no request that produced tokens")
    tokenizer = None
    if any(row["prompt_token_ids"] is None for row in rows):
        tokenizer = load_tokenizer(resolve_model_path(model or config.get("model")))
    requests = [_replay_request(row, started, tokenizer) for row in rows]
    return Workload(f"{path.name} session {session_id}", requests, config=config,
                    steps=stored.steps)


def _replay_request(row: dict, started: float, tokenizer) -> ReplayRequest:
    sampling = row["sampling_params"] or {}
    outputs = row["output_token_ids"]
    if outputs:
        length, recorded = len(outputs[0]), list(outputs[0])
    else:
        length, recorded = row["num_output_tokens"] // max(len(row["outputs"]), 1), None
    prompt = row["prompt_token_ids"]
    if prompt is None:
        prompt = tokenizer(row["prompt"] or "").input_ids
    arrival = row["arrival_offset_s"]
    if arrival is None:
        arrival = (row["arrival_time"] or started) - started
    return ReplayRequest(row["request_id"], arrival, list(prompt), max(length, 1), sampling,
                         recorded)


def load_logged_steps(path: str | Path, session_id: int | None = None) -> list:
    """The step records of session `session_id` (default: the latest with steps)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such session log")
    engine = open_database(path)
    try:
        if session_id is None:
            with_steps = [s["id"] for s in list_sessions(engine) if s["num_steps"]]
            if not with_steps:
                raise ValueError(f"{path}: no session with steps to fit a cost model to")
            session_id = with_steps[0]
        return load_session(engine, session_id).steps
    finally:
        engine.dispose()
