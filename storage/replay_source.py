"""A session of kvscope's own SQLite log as a replay workload: the requests as they arrived,
the config they ran under and the steps they took (a step-cost model fits to those).

This module is the replay's SessionLogReader (engine.replay.workload): the command line and
the Compare tab hand it to the replay, which never imports storage itself.
"""

from pathlib import Path

from kvscope.engine.replay.workload import ReplayRequest, Workload
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path
from kvscope.storage.reader import list_sessions, load_session
from kvscope.storage.schema import open_database


def load_session_workload(path: str | Path, session_id: int | None = None,
                          model: str | None = None) -> Workload:
    """Session `session_id` of the log (default: the latest with requests). Requests logged
    before schema version 5 kept no token ids or sampling: their prompt text is tokenized
    again (by `model`'s tokenizer, default the recorded model's) and they sample with the
    defaults."""
    path = Path(path)
    stored = _load_stored_session(path, session_id, "num_requests",
                                  "no session with requests in the log")
    session_id = stored.session["id"]
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
    return _load_stored_session(Path(path), session_id, "num_steps",
                                "no session with steps to fit a cost model to").steps


def _load_stored_session(path: Path, session_id: int | None, having: str, missing: str):
    """Session `session_id` of the log, or the latest whose `having` count is not zero."""
    if not path.is_file():
        raise ValueError(f"{path}: no such session log")
    engine = open_database(path)
    try:
        if session_id is None:
            candidates = [s["id"] for s in list_sessions(engine) if s[having]]
            if not candidates:
                raise ValueError(f"{path}: {missing}")
            session_id = candidates[0]
        return load_session(engine, session_id)
    finally:
        engine.dispose()
