"""Tests for storage: the session log's rows, exports, durability and schema upgrades."""

import csv
import dataclasses
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import inspect

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.replicas.router import CandidateScore, RoutingDecision
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import StepRecord
from kvscope.storage import SessionLog, export_session, load_session, open_database, schema
from kvscope.storage.models import StepRow
from kvscope.storage.reader import ROWS_PER_FETCH, table_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine_run(tiny_chat_model_path):
    """Step records and final outputs of a small run with a shared prefix and n=2."""
    core = EngineCore(EngineConfig(model=str(tiny_chat_model_path), dtype="float32",
                                   device="cpu", block_size=4, num_gpu_blocks_override=64,
                                   max_model_len=128, max_num_batched_tokens=32))
    shared = "You are a helpful assistant. "
    for index, n in enumerate((1, 2, 1)):
        core.add_request(f"{shared}question {index}", SamplingParams(
            max_tokens=6, temperature=0, n=n), source="api")
    records, finished = [], []
    while core.has_unfinished_requests():
        result = core.step()
        records.append(result.record)
        finished.extend(output for output in result.outputs if output.finished)
    return core.config.to_dict(), records, finished


def fake_record(step: int, start_time: float) -> StepRecord:
    return StepRecord(step=step, start_time=start_time, end_time=start_time + 0.001,
                      chunks=(), preempted=(), swapped_out=(), swapped_in=(), finished=(),
                      num_scheduled_tokens=1, token_budget=8, num_used_blocks=1,
                      num_cached_blocks=0, num_free_blocks=7, num_running=1, num_waiting=0)


def logged_session(db_path: Path, engine_run) -> tuple[int, SessionLog]:
    config, records, finished = engine_run
    log = SessionLog(db_path)
    session_id = log.start_session(config, model="tiny")
    for record in records:
        log.record_step(record)
    for output in finished:
        log.record_request(output, source="api")
    log.record_chat_message("conv-1", "user", "hello")
    log.record_chat_message("conv-1", "assistant", "hi there", request_id="req-0")
    return session_id, log


def drop_columns_after_version_4(connection: sqlite3.Connection) -> None:
    """Make a file as version 4 wrote it: without what versions 5 to 11 added."""
    for column, _ in schema.REQUEST_COLUMNS_OF_VERSION_5:
        connection.execute(f"ALTER TABLE requests DROP COLUMN {column}")
    for column in ("spec_drafts", "expert_layers", "expert_tokens", "expert_bytes_read",
                   "expert_bytes_all", "preemptions", "prefix_misses"):
        connection.execute(f"ALTER TABLE steps DROP COLUMN {column}")
    drop_columns_of_version_11(connection)
    connection.execute("DROP TABLE pool_records")


def drop_columns_of_version_11(connection: sqlite3.Connection) -> None:
    for column in schema.STEP_COLUMNS_OF_VERSION_11:
        connection.execute(f"ALTER TABLE steps DROP COLUMN {column}")


def test_every_request_and_step_of_a_run_is_stored(tmp_path: Path, engine_run) -> None:
    config, records, finished = engine_run
    session_id, log = logged_session(tmp_path / "log.db", engine_run)
    log.close()

    stored = load_session(open_database(tmp_path / "log.db"), session_id)
    assert stored.steps == records  # every field of every record survives the round trip
    assert stored.session["config"] == config
    assert stored.session["ended_at"] >= stored.session["started_at"]
    by_id = {row["request_id"]: row for row in stored.requests}
    assert by_id.keys() == {output.request_id for output in finished}
    for output in finished:
        row = by_id[output.request_id]
        assert row["outputs"] == [completion.text for completion in output.outputs]
        assert row["num_prompt_tokens"] == len(output.prompt_token_ids)
        assert row["num_cached_tokens"] == output.num_cached_tokens
        assert row["first_token_time"] == output.metrics.first_token_time
    assert sum(row["num_cached_tokens"] for row in stored.requests) > 0  # the shared prefix
    assert [m["role"] for m in stored.chat_messages] == ["user", "assistant"]


def test_requests_and_steps_keep_their_replica(tmp_path: Path, engine_run) -> None:
    _, records, finished = engine_run
    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session({}, model="tiny")
    on_replica_1 = [dataclasses.replace(record, replica=1) for record in records[:2]]
    for record in [*on_replica_1, *records[2:4]]:
        log.record_step(record)
    log.record_request(finished[0], source="api", replica=1)
    log.record_request(finished[1], source="api")
    log.close()
    stored = load_session(open_database(tmp_path / "log.db"), session_id)
    assert [step.replica for step in stored.steps] == [1, 1, 0, 0]
    assert {row["request_id"]: row["replica"] for row in stored.requests} == {
        finished[0].request_id: 1, finished[1].request_id: 0}


def test_routing_decisions_are_logged_with_every_candidate(tmp_path: Path) -> None:
    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session({}, model="tiny")
    decision = RoutingDecision("api-7", 1000.0, "kv-aware", 1, 12, (
        CandidateScore(0, 0, 0.25, -0.25), CandidateScore(1, 12, 0.5, 0.5)))
    log.record_routing(decision)
    log.close()
    engine = open_database(tmp_path / "log.db")
    [row] = load_session(engine, session_id).routing_decisions
    assert {key: row[key] for key in ("request_id", "time", "policy", "replica",
                                      "num_prompt_blocks", "matched_blocks")} == {
        "request_id": "api-7", "time": 1000.0, "policy": "kv-aware", "replica": 1,
        "num_prompt_blocks": 12, "matched_blocks": 12}
    assert row["candidates"] == [
        {"replica": 0, "matched_blocks": 0, "load": 0.25, "score": -0.25},
        {"replica": 1, "matched_blocks": 12, "load": 0.5, "score": 0.5}]
    exported = json.loads(export_session(engine, session_id, "json", tmp_path).read_text())
    assert exported["routing_decisions"][0]["candidates"] == row["candidates"]


def test_every_config_of_a_session_is_kept_with_its_time(tmp_path: Path, engine_run) -> None:
    config = engine_run[0]
    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session(config, model="tiny")
    changed = {**config, "block_size": 2 * config["block_size"]}
    for reported in (changed, changed, config):  # the app and the knobs tab both report
        log.record_config(reported)
    log.close()
    stored = load_session(open_database(tmp_path / "log.db"), session_id)
    assert [entry["config"] for entry in stored.configs] == [config, changed, config]
    times = [entry["applied_at"] for entry in stored.configs]
    assert times == sorted(times) and times[0] == stored.session["started_at"]
    assert stored.session["config"] == config  # the latest


def test_exports_round_trip(tmp_path: Path, engine_run) -> None:
    session_id, log = logged_session(tmp_path / "log.db", engine_run)
    assert log.flush()
    original = log.load_session(session_id)

    document = json.loads(log.export(session_id, "json", tmp_path / "out").read_text())
    assert document["sessions"][0]["config"] == original.session["config"]
    assert len(document["steps"]) == len(original.steps)
    assert document["requests"] == json.loads(json.dumps(original.requests))

    with zipfile.ZipFile(log.export(session_id, "csv", tmp_path / "out")) as archive:
        steps = list(csv.DictReader(io.StringIO(archive.read("steps.csv").decode())))
        assert set(archive.namelist()) == {"sessions.csv", "requests.csv", "steps.csv",
                                           "chat_messages.csv", "session_configs.csv",
                                           "routing_decisions.csv", "pool_records.csv"}
    assert [int(row["step"]) for row in steps] == [r.step for r in original.steps]
    assert json.loads(steps[0]["chunks"]) == [list(chunk) for chunk in original.steps[0].chunks]

    standalone = log.export(session_id, "sqlite", tmp_path / "out")
    log.close()
    leftovers = [p.name for p in standalone.parent.iterdir() if p.name.startswith(
        standalone.name + "-")]
    assert leftovers == []  # no -wal / -shm beside it: one self-contained file
    copy = load_session(open_database(standalone), session_id)
    assert copy == original


def test_export_of_a_missing_session_or_format_is_refused(tmp_path: Path) -> None:
    engine = open_database(tmp_path / "log.db")
    with pytest.raises(ValueError, match="session_id=42: no such session"):
        export_session(engine, 42, "json", tmp_path)
    with pytest.raises(ValueError, match="format='xml'"):
        export_session(engine, 1, "xml", tmp_path)
    with pytest.raises(ValueError, match="session_id=42"):
        load_session(engine, 42)
    # Found by tests/fuzz (the dashboard's session picker takes any number): an id SQLite
    # cannot hold is a missing session too, not an OverflowError.
    for too_big in (2 ** 63, -(2 ** 63) - 1, 10 ** 30):
        with pytest.raises(ValueError, match=f"session_id={too_big}: no such session"):
            export_session(engine, too_big, "json", tmp_path)
        with pytest.raises(ValueError, match=f"session_id={too_big}: no such session"):
            load_session(engine, too_big)


def test_a_session_left_open_by_a_killed_process_is_closed_by_the_next(tmp_path: Path) -> None:
    killed = SessionLog(tmp_path / "log.db")  # never closed: as if killed -9
    first = killed.start_session({}, model="tiny")
    last_step = time.time() + 100  # after the session's start: the last thing it logged
    killed.record_step(fake_record(0, last_step))
    assert killed.flush()
    restarted = SessionLog(tmp_path / "log.db")
    second = restarted.start_session({}, model="tiny")
    sessions = {s["id"]: s for s in restarted.list_sessions()}
    assert sessions[first]["ended_at"] == pytest.approx(last_step + 0.001)
    assert sessions[second]["ended_at"] is None  # the live one stays open
    restarted.close()
    killed.close()


def test_a_stalled_disk_drops_rows_instead_of_blocking(tmp_path: Path) -> None:
    db_path = tmp_path / "log.db"
    log = SessionLog(db_path, queue_size=100)
    log.start_session({}, model="tiny")
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the writer now waits on the busy timeout
    producer = threading.Thread(target=lambda: [
        log.record_step(fake_record(step, time.time())) for step in range(1000)])
    producer.start()
    producer.join(timeout=60)  # only catches a hang
    # All 1000 calls returned while the file was still locked: none waited for the disk.
    assert not producer.is_alive()
    assert log.num_dropped > 0
    blocker.execute("COMMIT")
    blocker.close()
    log.close()
    stored = load_session(open_database(db_path), log.session_id)
    assert len(stored.steps) == 1000 - log.num_dropped


def test_two_apps_share_one_file(tmp_path: Path) -> None:
    db_path = tmp_path / "log.db"
    logs = [SessionLog(db_path) for _ in range(2)]
    ids = [log.start_session({"app": index}, model="tiny") for index, log in enumerate(logs)]

    def write(log: SessionLog) -> None:
        for step in range(500):
            log.record_step(fake_record(step, time.time()))

    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for log in logs:
        log.close()
    engine = open_database(db_path)
    assert len(set(ids)) == 2
    for session_id in ids:
        assert [r.step for r in load_session(engine, session_id).steps] == list(range(500))
    with sqlite3.connect(db_path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from kvscope.engine.telemetry.records import StepRecord
    from kvscope.storage import SessionLog
    log = SessionLog(sys.argv[1])
    log.start_session({}, model="tiny")
    step = 0
    while True:
        now = time.time()
        log.record_step(StepRecord(step, now, now, (), (), (), (), (), 1, 8, 1, 0, 7, 1, 0))
        if step == 500:  # a second of steps at least: past two commit intervals
            print("writing", flush=True)
        step += 1
        time.sleep(0.002)  # an engine's pace of steps: the behaviour the log must keep up with
""")


def test_sigkill_mid_run_loses_at_most_the_last_second(tmp_path: Path) -> None:
    db_path = tmp_path / "log.db"
    process = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(db_path)],
                               cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    # Killed once it has logged for a while, at a point of its commit cycle its own pace
    # chose, not one this test picks.
    assert process.stdout.readline().strip() == "writing"
    killed_at = time.time()
    process.send_signal(signal.SIGKILL)
    process.wait()

    with sqlite3.connect(db_path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    steps = load_session(open_database(db_path), 1).steps
    assert [r.step for r in steps] == list(range(len(steps)))  # a prefix, no gaps
    assert steps[-1].start_time >= killed_at - 1.0


def test_a_version_2_log_gains_the_replica_columns_and_the_routing_table(tmp_path: Path) -> None:
    db_path = tmp_path / "old.db"
    log = SessionLog(db_path)
    log.start_session({}, model="tiny")
    log.close()
    with sqlite3.connect(db_path) as connection:  # the file as version 2 wrote it
        for table in ("requests", "steps"):
            connection.execute(f"ALTER TABLE {table} DROP COLUMN replica")
        connection.execute("DROP TABLE routing_decisions")  # and what versions 4 to 7 added
        drop_columns_after_version_4(connection)
        connection.execute("UPDATE schema_version SET version = 2")
    engine = schema.open_database(db_path)
    for table in ("requests", "steps"):
        assert "replica" in {c["name"] for c in inspect(engine).get_columns(table)}
    assert "spec_drafts" in {c["name"] for c in inspect(engine).get_columns("steps")}
    assert inspect(engine).has_table("routing_decisions")
    with engine.connect() as connection:
        assert (connection.exec_driver_sql("SELECT version FROM schema_version").scalar()
                == schema.SCHEMA_VERSION)


def test_schema_upgrades_from_the_previous_version(tmp_path: Path, monkeypatch) -> None:
    db_path = tmp_path / "log.db"
    log = SessionLog(db_path)
    log.start_session({}, model="tiny")
    log.close()
    current = schema.SCHEMA_VERSION

    def add_host_column(connection) -> None:
        connection.exec_driver_sql("ALTER TABLE sessions ADD COLUMN host TEXT")

    monkeypatch.setattr(schema, "SCHEMA_VERSION", current + 1)
    monkeypatch.setattr(schema, "MIGRATIONS", {current: add_host_column})
    engine = schema.open_database(db_path)
    columns = {column["name"] for column in inspect(engine).get_columns("sessions")}
    assert "host" in columns
    with engine.connect() as connection:
        assert (connection.exec_driver_sql("SELECT version FROM schema_version").scalar()
                == current + 1)
        assert connection.exec_driver_sql("SELECT count(*) FROM sessions").scalar() == 1

    monkeypatch.setattr(schema, "SCHEMA_VERSION", current)
    with pytest.raises(ValueError, match="newer kvscope"):
        schema.open_database(db_path)


def test_exports_of_a_long_session_stream_instead_of_holding_it(tmp_path: Path) -> None:
    """Each format writes rows a batch at a time: exporting takes far less memory than
    holding the session's step rows does."""
    log = SessionLog(tmp_path / "long.db")
    session_id = log.start_session({}, model="tiny")
    num_steps = 3 * ROWS_PER_FETCH
    for step in range(num_steps):
        log.record_step(fake_record(step, 1000.0 + step))
    assert log.flush(timeout=60)

    def peak_bytes(work) -> tuple[int, object]:
        tracemalloc.start()
        try:
            result = work()
            return tracemalloc.get_traced_memory()[1], result
        finally:
            tracemalloc.stop()

    held, rows = peak_bytes(lambda: table_rows(log.engine, StepRow, session_id))
    assert len(rows) == num_steps
    for fmt in ("json", "csv", "sqlite"):
        peak, path = peak_bytes(lambda fmt=fmt: log.export(session_id, fmt, tmp_path / "out"))
        assert peak < held / 2, fmt
    assert len(json.loads(path.with_suffix(".json").read_text())["steps"]) == num_steps
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT count(*) FROM steps").fetchone()[0] == num_steps
    with zipfile.ZipFile(path.with_suffix(".zip")) as archive:
        steps_csv = archive.read("steps.csv").decode()
    assert len(list(csv.DictReader(io.StringIO(steps_csv)))) == num_steps
    log.close()


def test_a_version_1_log_gains_the_step_statistics(tmp_path: Path, engine_run) -> None:
    """Version 1 had no per-step cache statistics: its steps read back with zeros."""
    db_path = tmp_path / "log.db"
    session_id, log = logged_session(db_path, engine_run)
    log.close()
    with sqlite3.connect(db_path) as connection:  # make it a version-1 file
        for column in schema.STEP_COLUMNS_OF_VERSION_2:
            connection.execute(f"ALTER TABLE steps DROP COLUMN {column}")
        for table in ("requests", "steps"):  # and what versions 3, 4 and 5 added
            connection.execute(f"ALTER TABLE {table} DROP COLUMN replica")
        connection.execute("DROP TABLE routing_decisions")
        drop_columns_after_version_4(connection)
        connection.execute("UPDATE schema_version SET version = 1")

    steps = load_session(open_database(db_path), session_id).steps

    _, records, _ = engine_run
    assert [r.step for r in steps] == [r.step for r in records]
    assert all(r.prefix_cache_queries == r.prefix_cache_hits == 0 for r in steps)
    assert sum(r.prefix_cache_hits for r in records) > 0  # the originals had some


def test_a_version_10_log_gains_the_tier_columns_and_its_steps_read_back_without_a_tier(
        tmp_path: Path) -> None:
    db_path = tmp_path / "old.db"
    log = SessionLog(db_path)
    session_id = log.start_session({}, model="tiny")
    tiered = dataclasses.replace(fake_record(0, time.time()), kv_tier=(3, 300, 1, 0, 2, 200, 1, 8, 8))
    log.record_step(tiered)
    log.close()
    assert load_session(open_database(db_path), session_id).steps == [tiered]
    with sqlite3.connect(db_path) as connection:
        drop_columns_of_version_11(connection)
        connection.execute("UPDATE schema_version SET version = 10")
    engine = open_database(db_path)
    columns = {column["name"] for column in inspect(engine).get_columns("steps")}
    assert set(schema.STEP_COLUMNS_OF_VERSION_11) <= columns
    assert load_session(engine, session_id).steps == [dataclasses.replace(tiered, kv_tier=())]


def test_requests_keep_what_a_replay_needs(tmp_path: Path, engine_run) -> None:
    """Prompt and output token ids, every sampling field and the arrival offset."""
    _, _, finished = engine_run
    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session({}, model="tiny")
    params = SamplingParams(max_tokens=6, temperature=0.5, seed=3, stop=["x"],
                            logit_bias={5: 1.0})
    log.record_request(finished[0], source="api", params=params)
    log.close()
    row = load_session(open_database(tmp_path / "log.db"), session_id).requests[0]
    assert row["prompt_token_ids"] == finished[0].prompt_token_ids
    assert row["output_token_ids"] == [c.token_ids for c in finished[0].outputs]
    assert SamplingParams.from_dict(row["sampling_params"]) == params
    assert row["arrival_offset_s"] == pytest.approx(
        finished[0].metrics.arrival_time - log.started_at)


def test_a_version_4_log_opens_and_its_requests_read_back_without_replay_fields(
        tmp_path: Path, engine_run) -> None:
    db_path = tmp_path / "old.db"
    session_id, log = logged_session(db_path, engine_run)
    log.close()
    with sqlite3.connect(db_path) as connection:
        drop_columns_after_version_4(connection)
        connection.execute("UPDATE schema_version SET version = 4")
    requests = load_session(open_database(db_path), session_id).requests
    assert len(requests) == len(engine_run[2])
    assert all(row["prompt_token_ids"] is None and row["sampling_params"] is None
               for row in requests)
    assert requests[0]["prompt"]  # the text a replay re-tokenizes


def test_the_sessions_list_gives_every_block_size_a_session_ran_the_most_used_first(
        tmp_path: Path) -> None:
    from kvscope.ui.sessions import block_sizes

    log = SessionLog(tmp_path / "log.db")
    log.start_session({"block_size": 16}, model="tiny")
    start = time.time()
    for step in range(3):
        log.record_step(fake_record(step, start + step * 1e-3))
    time.sleep(0.01)  # the reconfigure comes after those steps
    log.record_config({"block_size": 8})
    time.sleep(0.01)
    for step in range(3, 10):
        log.record_step(fake_record(step, time.time()))
    log.record_config({"block_size": 32})  # applied, nothing run with it yet
    assert log.flush()
    listed = log.list_sessions()[0]
    assert listed["block_sizes"] == [(8, 7), (16, 3), (32, 0)]
    assert block_sizes(listed) == "8 (7 steps), 16 (3 steps), 32 (0 steps)"
    assert listed["config"]["block_size"] == 32  # the latest, which it mostly did not run
    log.close()
