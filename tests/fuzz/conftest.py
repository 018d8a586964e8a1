"""The fuzzed servers: the API and the dashboard on the tiny chat model, and the budget.

The budget is the number of generated cases per route (hypothesis' max_examples): small by
default, so the suite's fuzz part stays short; `make fuzz` raises it through
$KVSCOPE_FUZZ_CASES (read when the fuzz modules are imported: hypothesis' settings are
decorators).
"""

import os
from dataclasses import dataclass

import httpx
import pytest
from conftest import dashboard_served, serve, wait_until

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.serving import create_app
from kvscope.storage import SessionLog

SHORT_BUDGET = 12
BUDGET_ENV = "KVSCOPE_FUZZ_CASES"
NUM_BLOCKS = 128
MAX_MODEL_LEN = 128
DASHBOARD_MAX_LEN = 64


def fuzz_budget() -> int:
    return int(os.environ.get(BUDGET_ENV, SHORT_BUDGET))


@dataclass
class FuzzedServer:
    url: str
    engine: AsyncEngine

    def assert_idle(self, timeout: float = 30.0) -> None:
        """Nothing running or waiting and no block held, as the engine and /metrics say."""
        wait_for_idle(self.engine, timeout)
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                   for line in httpx.get(f"{self.url}/metrics").text.splitlines()
                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                       "vllm:kv_cache_usage_perc"))}
        assert metrics == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                           "vllm:kv_cache_usage_perc": 0}


def engine_is_idle(engine: AsyncEngine) -> bool:
    snapshot = engine.snapshot()
    return (snapshot.count("used") + snapshot.count("shared") == 0
            and snapshot.num_running == 0 and snapshot.num_waiting == 0)


def wait_for_idle(engine: AsyncEngine, timeout: float) -> None:
    wait_until(lambda: engine_is_idle(engine), timeout=timeout, what="the engine to go idle")


def tiny_engine(model_path, **knobs) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(**{
        "model": str(model_path), "dtype": "float32", "device": "cpu", "block_size": 8,
        "num_gpu_blocks_override": NUM_BLOCKS, "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": 256, **knobs})).start()


@pytest.fixture(scope="module")
def api_server(tiny_chat_model_path) -> FuzzedServer:
    engine = tiny_engine(tiny_chat_model_path)
    url, uvicorn_server, thread = serve(create_app(engine))
    yield FuzzedServer(url, engine)
    uvicorn_server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


@dataclass
class FuzzedDashboard:
    url: str
    engine: AsyncEngine
    log: SessionLog


@pytest.fixture(scope="module")
def dashboard(tiny_chat_model_path, tmp_path_factory) -> FuzzedDashboard:
    """The dashboard as app.py serves it (engine, session log, recorder), on a short
    max_model_len so that even the largest generated load is over in seconds."""
    engine = tiny_engine(tiny_chat_model_path, block_size=4, max_model_len=DASHBOARD_MAX_LEN,
                         max_num_batched_tokens=64)
    with dashboard_served(engine, tmp_path_factory.mktemp("db") / "kvscope.db") as (log, url):
        yield FuzzedDashboard(url, engine, log)
    engine.shutdown()
