"""Schemathesis over the OpenAPI schema the FastAPI app publishes: every route, valid and
invalid bodies, each case checked against the properties a trusted server keeps."""

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis.generation.modes import GenerationMode

from fuzz.conftest import FuzzedServer, fuzz_budget
from kvscope.engine.serving.protocol import ChatCompletionRequest, CompletionRequest

# The client's timeout, not a speed target (those live in bench/): an accepted request runs
# at most MAX_MODEL_LEN tokens of the tiny model, n and beams included.
ANSWER_BOUND_S = 60.0
BUDGET = fuzz_budget()
pytestmark = pytest.mark.fuzz


# Every route in the schema (the test below fails if a new one is not fuzzed).
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"),
          ("GET", "/version"), ("GET", "/metrics")]
# The bodies that keep unknown keys (to refuse them by name), so generated cases have them.
OPEN_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
# A route without parameters has no invalid input to generate.
CASES = [(method, path, mode) for method, path in ROUTES for mode in GenerationMode
         if method == "POST" or mode is GenerationMode.POSITIVE]
# What the generated cases got, per route and status (printed at the end: how many of the
# cases reached the engine, not only its validation).
STATUSES: Counter = Counter()


@pytest.fixture(scope="module")
def api_schema(api_server: FuzzedServer):
    return schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")


def test_every_route_is_fuzzed(api_schema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in operations) == sorted(ROUTES)


def check_error_shape(status_code: int, body) -> None:
    """vLLM's (OpenAI's) error body, naming the field a 400 refuses."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    if status_code == 400:
        assert error["param"] is not None, f"a 400 that names no field: {error}"
        field = error["param"].split(".")[0]
        assert error["message"].startswith(field) or field in error["message"], error


@pytest.mark.parametrize(("method", "path", "mode"), CASES,
                         ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_every_route_keeps_its_properties(api_schema, api_server: FuzzedServer, method: str,
                                          path: str, mode: GenerationMode) -> None:
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and path in OPEN_BODIES:
        strategy = st.one_of(strategy, strategy.map(reaching_the_engine(OPEN_BODIES[path])))

    @given(case=strategy)
    @settings(max_examples=BUDGET, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def keeps_its_properties(case) -> None:
        check_case(case, api_server)

    keeps_its_properties()


def reaching_the_engine(body_model: type[BaseModel]):
    """A valid body that the engine runs: the schema lets extra keys through (each refused
    by name) and any model name (a 404), which leaves few cases for the engine itself."""
    declared = set(body_model.model_fields) - {"model"}

    def focus(case):
        if isinstance(case.body, dict):
            case.body = {key: value for key, value in case.body.items() if key in declared}
        return case

    return focus


def check_case(case, api_server: FuzzedServer) -> None:
    response = case.call(base_url=api_server.url, timeout=ANSWER_BOUND_S)
    STATUSES[f"{case.method} {case.path} {response.status_code}"] += 1
    where = f"{case.method} {case.path} {case.body!r:.400}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:400]}"
    if 400 <= response.status_code < 500:
        check_error_shape(response.status_code, response.json())
    health = httpx.get(f"{api_server.url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["step_failures"] == 0, health.text


def test_nothing_is_left_running_after_the_fuzzer(api_server: FuzzedServer) -> None:
    print(f"API: {sum(STATUSES.values())} generated cases, by route and status:",
          json.dumps(dict(sorted(STATUSES.items())), indent=1))
    api_server.assert_idle()
