"""One key guards every door: /v1, the websocket, the dashboard and every Gradio route.

One server with a key (API + dashboard, mounted as app.py mounts it) serves the module;
its whole log is captured, so the last test can check that the key never reached it.
"""

import importlib
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import httpx
import openai
import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, serve
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError
from websockets.sync.client import connect as ws_connect

from kvscope import ui
from kvscope.app import build_parser, mount_dashboard
from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.serving import create_app
from kvscope.engine.serving.security import exposure_warning, read_api_key
from kvscope.storage import SessionLog, record_sessions

API_KEY = "kvscope-test-key-7f3a9c"  # distinctive, so any leak is found by a plain search
BEARER = {"Authorization": f"Bearer {API_KEY}"}
REPO = Path(__file__).resolve().parents[1]
# Every named endpoint of the dashboard, with arguments that would change or reveal state.
GRADIO_CALLS = {
    "chat": ["Hello", 0.0, 1.0, 4],
    "refresh_live": [None],
    "apply_knobs": [8, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False],
    "start_load": [4, 1000.0, 0.5, 4, 8, 2, 4, 1],
    "list_sessions": [],
    "show_session": [1],
    "export_session": [1, "json"],
}
# Gradio's routes beyond the named calls: the page and the config/info routes that reveal
# the component tree, the queue, uploads, file downloads, and the lesser ones Gradio
# itself leaves without a login check (heartbeat, cancel, startup events, theme).
GRADIO_ROUTES = [
    ("GET", "/"), ("GET", "/config"), ("GET", "/gradio_api/info"),
    ("GET", "/gradio_api/openapi.json"), ("POST", "/gradio_api/queue/join"),
    ("GET", "/gradio_api/queue/data?session_hash=x"), ("POST", "/gradio_api/run/chat"),
    ("POST", "/gradio_api/call/v2/chat"), ("POST", "/gradio_api/upload"),
    ("GET", "/gradio_api/file=/etc/hostname"), ("GET", "/gradio_api/heartbeat/x"),
    ("POST", "/gradio_api/cancel"), ("GET", "/gradio_api/startup-events"),
    ("GET", "/theme.css"), ("GET", "/gradio_api/user"), ("GET", "/docs"),
    ("GET", "/openapi.json"),
]


@dataclass
class Guarded:
    url: str
    engine: AsyncEngine
    log: SessionLog
    db_path: Path
    log_lines: list[str]

    def gradio(self, **options) -> Client:
        return Client(f"{self.url}/", verbose=False, **{"headers": BEARER, **options})

    def openai(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=60)


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path) -> AsyncEngine:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=96, max_model_len=256, max_num_batched_tokens=64)).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def guarded(engine, tmp_path_factory) -> Guarded:
    """The app as app.py builds it with a key, every log line (access log included) kept."""
    lines: list[str] = []
    handler, root = _Lines(lines), logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    db_path = tmp_path_factory.mktemp("auth-db") / "kvscope.db"
    log = SessionLog(db_path)
    log.start_session(engine.config.to_dict(), engine.model_path)
    stop_recording = record_sessions(engine, log)
    app = mount_dashboard(create_app(engine, api_key=API_KEY), engine, log)
    # log_config=None: uvicorn's access log propagates to the root logger, and the handler.
    url, server, thread = serve(app, log_config=None, log_level="info")
    yield Guarded(url, engine, log, db_path, lines)
    server.should_exit = True
    thread.join(timeout=10)
    stop_recording()
    log.close()
    root.removeHandler(handler)
    root.setLevel(previous_level)


def _server(app):
    url, server, thread = serve(app, log_config=None)
    return url, lambda: (setattr(server, "should_exit", True), thread.join(timeout=10))


# ---- the API and the websocket ----------------------------------------------------------
def test_api_refuses_without_the_key_and_serves_with_it(guarded) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")):
        assert httpx.request(method, guarded.url + path, json={}).status_code == 401
    for key in ("wrong", API_KEY[:-1], API_KEY + "x"):
        client = guarded.openai(key)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=None, prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=None, max_tokens=1,
                                           messages=[{"role": "user", "content": "x"}])
    wrong = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    client = guarded.openai(API_KEY)
    assert [model.id for model in client.models.list().data]
    assert client.completions.create(model=None, prompt="x", max_tokens=2).choices
    assert client.chat.completions.create(
        model=None, max_tokens=2, messages=[{"role": "user", "content": "x"}]).choices


def test_a_dashboard_session_does_not_open_the_openai_api(guarded) -> None:
    """/v1 is for API clients: only the bearer key opens it, not the browser's cookie."""
    with httpx.Client(base_url=guarded.url) as browser:
        assert browser.post("/login", data={"password": API_KEY}).status_code == 200
        assert browser.get("/config").status_code == 200
        assert browser.get("/v1/models").status_code == 401


def test_websocket_needs_the_key_or_a_session(guarded) -> None:
    ws_url = guarded.url.replace("http", "ws") + "/ws/events"
    for headers in ({}, {"Authorization": "Bearer nope"}):
        with pytest.raises(Exception, match="403|rejected"):
            with ws_connect(ws_url, additional_headers=headers) as websocket:
                websocket.recv(timeout=5)
    with ws_connect(ws_url, additional_headers=BEARER) as websocket:
        assert json.loads(websocket.recv(timeout=10))["type"] == "pool_base"
    with httpx.Client(base_url=guarded.url) as browser:
        browser.post("/login", data={"password": API_KEY})
        cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    with ws_connect(ws_url, additional_headers={"Cookie": cookie}) as websocket:
        assert json.loads(websocket.recv(timeout=10))["type"] == "pool_base"


def test_probes_stay_open_and_metrics_auth_closes_metrics(guarded, engine) -> None:
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(guarded.url + path).status_code == 200
    url, stop = _server(create_app(engine, api_key=API_KEY, metrics_auth=True))
    try:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert "kvscope:engine_steps" in httpx.get(f"{url}/metrics", headers=BEARER).text
        assert httpx.get(f"{url}/health").status_code == 200
        # A key in a URL ends up in access logs and browser history: not accepted.
        with pytest.raises(Exception, match="403|rejected"):
            with ws_connect(f"{url.replace('http', 'ws')}/ws/events?api_key={API_KEY}") as ws:
                ws.recv(timeout=5)
    finally:
        stop()


# ---- the dashboard and its Gradio API ---------------------------------------------------
@pytest.mark.parametrize(("method", "path"), GRADIO_ROUTES)
def test_every_gradio_route_refuses_without_a_session(guarded, method, path) -> None:
    response = httpx.request(method, guarded.url + path, files={"files": ("a.txt", b"x")}
                             if path.endswith("/upload") else None)
    assert response.status_code == 401
    assert "kv-heatmap" not in response.text and "apply_knobs" not in response.text
    # A browser asking for a page is sent to the login page instead.
    if method == "GET":
        page = httpx.get(guarded.url + path, headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == "/login"


def test_gradio_routes_open_with_the_bearer_key(guarded) -> None:
    assert "kv-heatmap" in httpx.get(f"{guarded.url}/config", headers=BEARER).text
    assert "/export_session" in httpx.get(f"{guarded.url}/gradio_api/info",
                                          headers=BEARER).text
    upload = httpx.post(f"{guarded.url}/gradio_api/upload", headers=BEARER,
                        files={"files": ("a.txt", b"x")})
    assert upload.status_code == 200 and upload.json()[0].endswith("a.txt")


def test_named_gradio_endpoints_refuse_and_do_nothing_without_the_key(guarded) -> None:
    engine = guarded.engine
    config, counters = engine.config, engine.counters()
    sessions = guarded.log.list_sessions()
    with pytest.raises(AuthenticationError):
        Client(f"{guarded.url}/", verbose=False)
    with pytest.raises(AuthenticationError):
        Client(f"{guarded.url}/", verbose=False, auth=("kvscope", "wrong"))
    for name, data in GRADIO_CALLS.items():
        for route in (f"/gradio_api/call/{name}", f"/gradio_api/run/{name}"):
            response = httpx.post(guarded.url + route, json={"data": data})
            assert response.status_code == 401, route
        joined = httpx.post(f"{guarded.url}/gradio_api/queue/join",
                            json={"data": data, "fn_index": 0, "session_hash": "x"})
        assert joined.status_code == 401
    assert engine.config is config and engine.config.block_size == 4
    assert engine.counters() == counters and not engine.snapshot().sequences
    assert guarded.log.list_sessions() == sessions


def test_named_gradio_endpoints_work_with_the_key(guarded) -> None:
    engine, client = guarded.engine, guarded.gradio()
    _, _, status = client.predict(*GRADIO_CALLS["chat"], api_name="/chat")
    assert "4 output tokens" in status
    assert "blocks" in client.predict(api_name="/refresh_live")[0]
    load = client.predict(*GRADIO_CALLS["start_load"], api_name="/start_load")
    assert "load generator** run 1" in load and " of 4 " in load
    status = client.predict(*GRADIO_CALLS["apply_knobs"], api_name="/apply_knobs")
    assert status.startswith("Applied") and engine.config.block_size == 8
    client.predict(4, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False, api_name="/apply_knobs")
    table, _, _ = client.predict(api_name="/list_sessions")
    assert table["data"][0][0] == guarded.log.session_id
    *_, config = client.predict(guarded.log.session_id, api_name="/show_session")
    assert config["latest"]["block_size"] == 4
    path, _ = client.predict(guarded.log.session_id, "json", api_name="/export_session")
    assert json.loads(Path(path).read_text())["sessions"][0]["id"] == guarded.log.session_id
    # gradio_client's own login (`auth=`) posts the key to /login and keeps the cookie.
    by_login = Client(f"{guarded.url}/", verbose=False, auth=("anyone", API_KEY))
    assert by_login.predict(api_name="/list_sessions")[0]["data"]


def test_export_downloads_need_the_key_and_hold_no_key(guarded) -> None:
    client = guarded.gradio(download_files=False)
    for fmt in ("json", "csv", "sqlite"):
        file, _ = client.predict(guarded.log.session_id, fmt, api_name="/export_session")
        assert httpx.get(file["url"]).status_code == 401
        assert httpx.get(file["url"], headers={"Authorization": "Bearer x"}).status_code == 401
        download = httpx.get(file["url"], headers=BEARER)
        assert download.status_code == 200 and len(download.content) > 0
        assert API_KEY.encode() not in download.content
    with httpx.Client(base_url=guarded.url) as browser:
        assert browser.post("/login", data={"password": API_KEY}).status_code == 200
        assert browser.get(file["url"]).status_code == 200


def test_login_page_sets_a_session_and_logout_ends_it(guarded) -> None:
    with httpx.Client(base_url=guarded.url, headers={"Accept": "text/html"}) as browser:
        assert "API key" in browser.get("/login").text
        refused = browser.post("/login", data={"password": "wrong"})
        assert refused.status_code == 401 and "Wrong API key" in refused.text
        assert not browser.cookies
        accepted = browser.post("/login", data={"password": API_KEY})
        assert accepted.status_code == 303 and accepted.headers["location"] == "/"
        cookie = accepted.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=lax" in cookie
        page = browser.get("/")
        assert page.status_code == 200 and "kv-heatmap" in page.text
        browser.get("/logout")
        assert browser.get("/").status_code == 303
        token = accepted.cookies
        assert httpx.get(f"{guarded.url}/config", cookies=token).status_code == 401


def test_a_session_counts_only_from_the_dashboards_own_origin(guarded) -> None:
    """Pages of other origins (of the same site, which SameSite=Lax lets the cookie reach)
    must not drive the dashboard with its user's session."""
    own = guarded.url.removeprefix("http://")
    config = guarded.engine.config
    with httpx.Client(base_url=guarded.url) as browser:
        browser.post("/login", data={"password": API_KEY})
        foreign = {"Origin": "http://127.0.0.1:1"}
        refused = browser.post("/gradio_api/call/apply_knobs", headers=foreign,
                               json={"data": GRADIO_CALLS["apply_knobs"]})
        assert refused.status_code == 403 and "Host header" in refused.text
        assert browser.get("/config", headers={"Origin": f"http://{own}"}).status_code == 200
        cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    assert guarded.engine.config is config
    # The bearer key is not something another origin's page can send for its user.
    assert httpx.get(f"{guarded.url}/config", headers={**BEARER, **foreign}).status_code == 200
    ws_url = guarded.url.replace("http", "ws") + "/ws/events"
    with pytest.raises(Exception, match="403|rejected"):
        with ws_connect(ws_url, additional_headers={"Cookie": cookie, **foreign}) as websocket:
            websocket.recv(timeout=5)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_browser_logs_in_through_the_page(guarded) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(guarded.url)
        assert page.url.endswith("/login")
        page.locator("#password").fill("wrong")
        page.locator("#login").click()
        expect(page.locator("#login-error")).to_contain_text("Wrong API key")
        refused = []
        page.on("response",
                lambda r: refused.append(r.url) if r.status in (401, 403) else None)
        page.locator("#password").fill(API_KEY)
        page.locator("#login").click()
        page.locator("#kv-message textarea").fill("Hi through the login")
        page.locator("#kv-message textarea").press("Enter")
        expect(page.locator("#kv-chat")).to_contain_text("TTFT", timeout=30_000)
        page.get_by_role("tab", name="Sessions").click()
        expect(page.locator("#kv-sessions-status")).to_contain_text(re.compile(r"sessions? in "))
        # The page's every request carried the session (its timers' polls included);
        # counted before the logout, after which a poll in flight may well be refused.
        assert not refused
        page.goto(f"{guarded.url}/logout")
        assert page.url.endswith("/login")
        page.goto(guarded.url)
        assert page.url.endswith("/login")  # the session ended with the logout
        browser.close()


# ---- without a key ----------------------------------------------------------------------
def test_without_a_key_on_loopback_everything_is_open(engine, tmp_path: Path) -> None:
    log = SessionLog(tmp_path / "open.db")
    log.start_session(engine.config.to_dict(), engine.model_path)
    url, stop = _server(mount_dashboard(create_app(engine), engine, log))
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 200
        assert httpx.get(f"{url}/config").status_code == 200
        table, _, _ = Client(f"{url}/", verbose=False).predict(api_name="/list_sessions")
        assert table["data"][0][0] == log.session_id
    finally:
        stop()
        log.close()


def test_exposure_warning_names_what_is_open_unless_silenced() -> None:
    warning = exposure_warning("0.0.0.0", None, False, "kv.db")
    assert "WITHOUT an API key" in warning and "kv.db" in warning
    assert "--allow-unauthenticated" in warning
    assert exposure_warning("0.0.0.0", None, True, "kv.db") is None
    assert exposure_warning("0.0.0.0", API_KEY, False, "kv.db") is None
    for loopback in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert exposure_warning(loopback, None, False, "kv.db") is None
    assert exposure_warning("my-host.example", None, False, "kv.db") is not None


def test_key_comes_from_the_flag_or_the_environment_and_is_never_empty(monkeypatch) -> None:
    monkeypatch.setenv("KVSCOPE_API_KEY", API_KEY)
    assert read_api_key(None) == API_KEY and read_api_key("other") == "other"
    assert API_KEY not in build_parser().format_help()
    monkeypatch.setenv("KVSCOPE_API_KEY", "")
    with pytest.raises(ValueError, match="KVSCOPE_API_KEY is set but empty"):
        read_api_key(None)
    monkeypatch.delenv("KVSCOPE_API_KEY")
    assert read_api_key(None) is None
    with pytest.raises(ValueError, match="api_key"):
        create_app(None, api_key="  ")


def test_app_warns_once_when_exposed_without_a_key(tiny_chat_model_path, tmp_path) -> None:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_API_KEY"}
    process = subprocess.Popen(
        [sys.executable, "app.py", "--host", "0.0.0.0", "--port", str(port), "--no-ui",
         "--model", str(tiny_chat_model_path), "--dtype", "float32", "--device", "cpu",
         "--db", str(tmp_path / "kv.db"), "--log-level", "info"],
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "Uvicorn running" in line or process.poll() is not None:
                break
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        lines += process.stderr.readlines()
        process.wait(timeout=30)
    warnings = [line for line in lines if "WITHOUT an API key" in line]
    assert len(warnings) == 1, "".join(lines)


def test_gradio_analytics_are_off_unless_asked_for(monkeypatch) -> None:
    monkeypatch.delenv("GRADIO_ANALYTICS_ENABLED", raising=False)
    importlib.reload(ui)
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    assert gr.Blocks().analytics_enabled is False
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "True")
    importlib.reload(ui)
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "True"


# ---- last: everything above ran; the key must not have leaked anywhere ------------------
def test_the_key_is_never_in_metrics_the_log_or_the_session_db(guarded) -> None:
    assert API_KEY not in httpx.get(f"{guarded.url}/metrics").text
    assert guarded.log_lines and any("/gradio_api/" in line for line in guarded.log_lines)
    assert not [line for line in guarded.log_lines if API_KEY in line]
    guarded.log.flush(timeout=5.0)
    for file in guarded.db_path.parent.iterdir():  # the database, its WAL and journal
        assert API_KEY.encode() not in file.read_bytes(), file.name
    with sqlite3.connect(guarded.db_path) as connection:
        configs = [row[0] for row in connection.execute("SELECT config FROM sessions")]
    assert configs and not [config for config in configs if API_KEY in config]
