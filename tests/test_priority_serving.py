"""`priority` at the edges: the OpenAI body (through the real openai client) and
LLM.generate, under scheduling_policy="priority"; a bad value is a 400 naming the field."""

import openai
import pytest
from test_serving import LiveServer, api_served, assert_idle

from kvscope import LLM, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def server(tiny_byte_level_model_path) -> LiveServer:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_byte_level_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=128, scheduling_policy="priority")).start()
    with api_served(engine) as server:
        yield server
    engine.shutdown()


def create(server: LiveServer, route: str, priority, stream: bool = False):
    client = server.client()
    if route == "completions":
        return client.completions.create(model=server.model, prompt="Hi", max_tokens=3,
                                         stream=stream, extra_body={"priority": priority})
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        stream=stream, extra_body={"priority": priority})


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_priorities_are_400s_naming_the_field(server, route):
    for value in (1.5, "1", True, 2 ** 31, -(2 ** 31) - 1, None):
        with pytest.raises(openai.BadRequestError) as error:
            create(server, route, value)
        assert error.value.body["param"] == "priority", (value, error.value.body)
        assert "priority" in error.value.body["message"]
    assert_idle(server)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_priority_is_served_streaming_or_not(server, route):
    answer = create(server, route, -3)
    assert answer.choices[0].finish_reason == "length"
    chunks = list(create(server, route, 7, stream=True))
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason == "length"
    assert_idle(server)


def test_llm_generate_serves_the_lowest_priority_value_first(tiny_model):
    """One seat: the prompts run one after another, in priority order, not prompt order."""
    llm = LLM(str(tiny_model("llama").path), dtype="float32", device="cpu", max_num_seqs=1,
              scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12]], params, use_tqdm=False,
                           priority=[2, 0, 1])
    starts = [o.metrics.first_scheduled_time for o in outputs]
    assert starts[1] < starts[2] < starts[0]
    with pytest.raises(ValueError, match="priority: 2 given for 3 prompts"):
        llm.generate([[5], [6], [7]], params, use_tqdm=False, priority=[0, 1])


def test_llm_refuses_a_priority_under_fcfs(tiny_model):
    llm = LLM(str(tiny_model("llama").path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, priority=4)
