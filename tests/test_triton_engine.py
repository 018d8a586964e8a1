"""The whole engine with the Triton kernels (interpreted on the CPU) matches the torch path."""

import importlib.util

import pytest

import kernels
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def test_triton_backend_gives_the_same_greedy_tokens(make_engine, run_engine, monkeypatch):
    # Prompts that end mid-block, exactly on a block, and span several blocks, run as a
    # mix of chunked prefills (budget 24) and decodes.
    prompts = [[5, 9, 13], list(range(1, 9)), list(range(40, 61))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def greedy_tokens() -> list[list[int]]:
        engine = make_engine("llama", block_size=8, max_num_batched_tokens=24)
        return [o.outputs[0].token_ids for o in run_engine(engine, prompts, params).outputs]

    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", "torch")
    expected = greedy_tokens()
    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", "triton")
    assert kernels.attention_backend_name("cpu") == "triton"
    assert greedy_tokens() == expected
