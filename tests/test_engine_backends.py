"""The whole engine on each attention backend gives the torch path's greedy tokens."""

import importlib.util

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams

# Prompts that end mid-block, exactly on a block, and span several blocks, run as a mix of
# chunked prefills (budget 24) and decodes.
PROMPTS = [[5, 9, 13], list(range(1, 9)), list(range(40, 61))]


def greedy_tokens(monkeypatch, tiny_model, run_engine, backend: str) -> list[list[int]]:
    """A runner of its own (the backend is chosen when a runner starts) on the tiny Llama."""
    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", backend)
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          device_memory_gb=0.05, block_size=8, max_num_batched_tokens=24)
    runner = ModelRunner(config)
    assert runner.attention_backend.name == backend
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_engine(EngineCore(config, runner=runner), PROMPTS, params).outputs
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed")
def test_triton_backend_gives_the_same_greedy_tokens(tiny_model, run_engine, monkeypatch):
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch")
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "triton") == expected


def test_cpu_backend_gives_the_same_greedy_tokens(tiny_model, run_engine, monkeypatch):
    """The C++ attention and fused forward ops against the plain-torch path, end to end."""
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch")
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "cpu") == expected
