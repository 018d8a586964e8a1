"""Every EngineConfig knob has a server flag (kvscope/app.py), and the README's knob table names it."""

import re
import time
from dataclasses import fields
from pathlib import Path

import pytest

from kvscope.app import build_parser, engine_config, main
from kvscope.engine.config import EngineConfig

README = Path(__file__).resolve().parents[1] / "README.md"
KNOBS = {field.name for field in fields(EngineConfig)}


def test_every_knob_is_a_flags_destination_and_defaults_agree():
    parser = build_parser()
    assert KNOBS <= {action.dest for action in parser._actions}
    assert engine_config(parser.parse_args([])) == EngineConfig()


def test_the_newer_flags_reach_the_config():
    args = build_parser().parse_args([
        "--seed", "7", "--long-prefill-token-threshold", "64",
        "--num-gpu-blocks-override", "100", "--no-prefix-caching", "--no-chunked-prefill"])
    config = engine_config(args)
    assert (config.seed, config.long_prefill_token_threshold,
            config.num_gpu_blocks_override) == (7, 64, 100)
    assert not config.enable_prefix_caching and not config.enable_chunked_prefill


def test_the_readme_knob_table_maps_each_knob_to_its_flag():
    flags = {option: action.dest for action in build_parser()._actions
             for option in action.option_strings}
    rows = re.findall(r"^\| `(\w+)` \| `(--[\w-]+)`", README.read_text(), re.M)
    assert {knob for knob, _ in rows} == KNOBS
    for knob, flag in rows:
        assert flags.get(flag) == knob, f"README: {flag} does not set {knob}"


@pytest.mark.parametrize("flags, named", [
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice"),
    (["--kv-events-config", '{"publisher": "kafka"}'], "kv_events_config.publisher"),
    (["--kv-events-config", "[1]"], "kv_events_config"),
    (["--replicas", "2", "--kv-events-config",
      '{"enable_kv_cache_events": true, "publisher": "zmq"}'], "one engine"),
])
def test_vllm_feature_flags_refuse_bad_values_before_loading(flags, named, capsys):
    with pytest.raises(SystemExit):
        main(flags)
    assert named in capsys.readouterr().err


def test_an_idle_connection_outlives_a_clients_pool_expiry():
    """A client (httpx: 5 s) may reuse a pooled connection until its own expiry; the server
    must not have closed it by then, or the request sent on it is reset unread."""
    import http.client
    import socket
    import threading

    import httpx
    import uvicorn
    from conftest import wait_until
    from fastapi import FastAPI

    from kvscope.app import server_config

    ping = FastAPI()
    ping.get("/ping")(lambda: "pong")
    server = uvicorn.Server(server_config(ping, build_parser().parse_args(["--log-level",
                                                                           "warning"])))
    listening = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True).start()
    wait_until(lambda: server.started, timeout=30, what="the server to start")
    connection = http.client.HTTPConnection(*listening.getsockname(), timeout=10)
    try:
        for _ in range(2):  # the second on the same socket, idle past the pool's expiry
            connection.request("GET", "/ping")
            assert connection.getresponse().read() == b'"pong"'
            time.sleep(httpx.Limits().keepalive_expiry + 1)
    finally:
        connection.close()
        server.should_exit = True
