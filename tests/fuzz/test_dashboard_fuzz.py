"""The dashboard's Gradio API through gradio_client: generated values for every knob of
every handler. A handler refuses bad values in its status text (or Gradio refuses them
with its own message); none may raise, and the engine must be idle once the loads end."""

import re
from collections import Counter

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.conftest import FuzzedDashboard, fuzz_budget, wait_for_idle

# Every named endpoint of the page (the first test fails if one is added and not fuzzed).
ENDPOINTS = ["/scenario_0", "/scenario_1", "/scenario_2", "/scenario_3", "/chat",
             "/check_view_fields", "/check_frame", "/what_if", "/apply_knobs", "/start_load",
             "/list_sessions", "/show_session", "/export_session", "/compare_runs", "/refresh_live",
             "/new_conversation", "/pause", "/resume", "/step_back", "/step_forward",
             "/session_frame", "/session_frame_back", "/session_frame_forward"]
# What gradio_client reports when a handler raised (rather than answered with a refusal).
CRASHED = "has raised an exception"
CALL_TIMEOUT_S = 60
BUDGET = fuzz_budget()
CALLS: Counter = Counter()  # generated calls per handler, printed at the end
pytestmark = pytest.mark.fuzz
RANGE = re.compile(r"between (-?[\d.]+) and (-?[\d.]+)")
# Integers near the edges the handlers check (ranges, token limits, int32), and a few in
# the middle; Numbers of any size are reachable through the API.
EDGE_INTEGERS = st.sampled_from([-(2 ** 31), -1, 0, 1, 2, 7, 8, 9, 64, 65, 1000, 1001, 2 ** 31,
                                 10 ** 12])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def values_for(parameter: dict) -> st.SearchStrategy:
    """Mostly what the component would send, sometimes what only an API caller would
    (NaN and infinities are not JSON, so no client can send them)."""
    schema, component = parameter["type"], parameter["component"]
    odd = st.none()
    if "enum" in schema:
        # The session pickers start with no choices; ids near the logged ones, and beyond.
        listed = st.sampled_from(schema["enum"]) if schema["enum"] else st.nothing()
        return listed | st.text(max_size=6) | st.integers(-1, 3) | EDGE_INTEGERS | odd
    if component == "Slider":
        # Gradio's Slider itself fails on None (before any handler): not sent.
        low, high = map(float, RANGE.search(schema["description"]).groups())
        return st.floats(low, high) | st.floats(low - 10, high + 10)
    if schema.get("type") == "integer":
        return st.integers(-3, 70) | EDGE_INTEGERS | odd
    if schema.get("type") == "number":
        return st.floats(-10, 2000) | st.sampled_from([0.0, -0.0, 1e300]) | odd
    if schema.get("type") == "boolean":
        return st.booleans() | odd
    if schema.get("type") == "string":
        return st.text(max_size=40) | odd
    if component == "File":
        return odd  # no upload: the handler sees no file
    return JSON


@pytest.fixture(scope="module")
def client(dashboard: FuzzedDashboard) -> Client:
    return Client(dashboard.url, verbose=False)


@pytest.fixture(scope="module")
def endpoints(client: Client) -> dict:
    return client.view_api(return_format="dict", print_info=False)["named_endpoints"]


def test_every_endpoint_is_fuzzed(endpoints) -> None:
    assert sorted(endpoints) == sorted(ENDPOINTS)


@pytest.mark.parametrize("api_name", ENDPOINTS)
def test_every_handler_answers_whatever_it_is_sent(client, endpoints, api_name) -> None:
    parameters = endpoints[api_name]["parameters"]
    arguments = st.tuples(*(values_for(parameter) for parameter in parameters))

    @given(arguments=arguments)
    @settings(max_examples=BUDGET, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def answers(arguments) -> None:
        CALLS[api_name] += 1
        try:
            client.submit(*arguments, api_name=api_name).result(timeout=CALL_TIMEOUT_S)
        except AppError as error:
            assert CRASHED not in str(error), f"{api_name}{arguments!r} raised in the handler"

    answers()


def test_the_engine_is_idle_once_the_fuzzed_loads_end(dashboard: FuzzedDashboard) -> None:
    print(f"dashboard: {sum(CALLS.values())} generated calls:", dict(CALLS))
    wait_for_idle(dashboard.engine, timeout=120)
