"""kill -9 in a loop: app.py under load is SIGKILLed at random moments, restarted on the
same --db each time, and after each restart the session log is checked. Prints JSON.

After each restart: the SQLite file passes `PRAGMA integrity_check`; every request that got
its final answer before the kill (a whole body, or a stream's [DONE]) has its row; every
session but the live one is closed; a killed session still exports.

    python bench/crash_loop.py --kills 20
"""

import argparse
import json
import random
import signal
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import httpx
from random_model import save_random_llama
from served import cpu_name, start_app, stop_app

from kvscope.storage import export_session, open_database

CLIENTS = 6
REQUEST_TIMEOUT_S = 60
FIRST_ANSWER_TIMEOUT_S = 120


def load(url: str, stop: threading.Event, acknowledged: list[str], seed: int) -> None:
    """One client: completions whole and streamed, until `stop` (or the server dies)."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        while not stop.is_set():
            body = {"prompt": " ".join(f"<{rng.randrange(1, 500)}>" for _ in range(rng.randint(4, 40))),
                    "max_tokens": rng.randint(1, 24), "n": rng.choice([1, 1, 2])}
            try:
                if rng.random() < 0.5:
                    answer = http.post("/v1/completions", json=body)
                    if answer.status_code == 200:
                        acknowledged.append(answer.json()["id"])
                    continue
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
                    events = [line for line in answer.iter_lines() if line.startswith("data: ")]
                if events and events[-1] == "data: [DONE]":
                    acknowledged.append(json.loads(events[0].removeprefix("data: "))["id"])
            except (httpx.HTTPError, json.JSONDecodeError):
                if stop.is_set():
                    return
                time.sleep(0.05)  # the server is gone: the loop's kill, or a restart


def check_log(db: Path, acknowledged: list[str], live_session: int | None,
              out_dir: Path) -> dict:
    with sqlite3.connect(db) as connection:
        integrity = connection.execute("PRAGMA integrity_check").fetchone()[0]
        logged = {row[0] for row in connection.execute("SELECT request_id FROM requests")}
        sessions = connection.execute("SELECT id, ended_at FROM sessions").fetchall()
    missing = [answer_id for answer_id in acknowledged if answer_id.split("-", 1)[1] not in logged]
    unclosed = [sid for sid, ended_at in sessions if ended_at is None and sid != live_session]
    killed = max((sid for sid, _ in sessions if sid != live_session), default=None)
    exported = None
    if killed is not None:
        engine = open_database(db)
        try:
            exported = json.loads(export_session(engine, killed, "json", out_dir).read_text())
        finally:
            engine.dispose()
    return {"integrity": integrity, "acknowledged": len(acknowledged), "missing": missing,
            "unclosed_sessions": unclosed,
            "export_ok": exported is not None and len(exported["sessions"]) == 1}


def live_session_id(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return connection.execute("SELECT MAX(id) FROM sessions").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--min-s", type=float, default=0.5,
                        help="earliest kill after the first acknowledged answer")
    parser.add_argument("--max-s", type=float, default=4.0, help="latest kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--db", default=None, help="the session log (default: a fresh file)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-crash-loop-"))
    db = Path(args.db) if args.db else workdir / "kvscope.db"
    model = save_random_llama(workdir / "model", vocab_size=512, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              max_positions=512)
    app_args = ["--no-ui", "--db", str(db), "--model", str(model), "--dtype", "float32",
                "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "256",
                "--log-level", "warning"]
    rounds = []
    app = start_app(app_args)
    for kill in range(args.kills):
        acknowledged: list[str] = []
        stop = threading.Event()
        clients = [threading.Thread(target=load, args=(app.url, stop, acknowledged, 1000 * kill + i))
                   for i in range(CLIENTS)]
        for client in clients:
            client.start()
        # The random moment is counted from the first answer, so every round kills with
        # requests acknowledged and others in flight, however slow the machine is.
        deadline = time.monotonic() + FIRST_ANSWER_TIMEOUT_S
        while not acknowledged and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(args.min_s, args.max_s))
        app.process.send_signal(signal.SIGKILL)
        app.process.wait()
        stop.set()
        for client in clients:
            client.join()
        app.workdir.cleanup()
        app = start_app(app_args)  # the same --db (the last --db flag wins)
        result = check_log(db, acknowledged, live_session_id(db), workdir / "exports")
        rounds.append(result)
        print(json.dumps({"kill": kill + 1, **result, "missing": len(result["missing"])}),
              flush=True)
    stop_app(app)
    final = check_log(db, [], None, workdir / "exports")
    passed = [r["integrity"] == "ok" and not r["missing"] and not r["unclosed_sessions"]
              and r["export_ok"] for r in rounds]
    print(json.dumps({
        "bench": "crash_loop", "cpu": cpu_name(), "kills": args.kills,
        "rounds_passed": sum(passed),
        "integrity_ok": sum(r["integrity"] == "ok" for r in rounds),
        "acknowledged": sum(r["acknowledged"] for r in rounds),
        "acknowledged_missing": sum(len(r["missing"]) for r in rounds),
        "sessions_left_open": sorted({s for r in rounds for s in r["unclosed_sessions"]}),
        "exports_ok": sum(r["export_ok"] for r in rounds),
        "after_clean_stop": {"integrity": final["integrity"],
                             "unclosed_sessions": final["unclosed_sessions"]},
        "db": str(db)}, indent=1))


if __name__ == "__main__":
    main()
