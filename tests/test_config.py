"""Configuration and request validation: bad values fail fast, naming the knob and the limit."""

import re
import shutil

import pytest
import torch
from transformers import GPT2Config

from kvscope import LLM, EngineConfig, SamplingParams
from kvscope.engine.config import MAX_BLOCK_SIZE

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(("knob", "value", "limit"), [
    ("block_size", 0, "power of two between 1 and 256"),
    ("block_size", 3, "power of two"),
    ("block_size", 512, "between 1 and 256"),
    ("block_size", -16, "power of two"),
    ("block_size", 16.0, "power of two"),
    ("block_size", True, "power of two"),
    ("gpu_memory_utilization", 0, "(0, 1]"),
    ("gpu_memory_utilization", 1.5, "(0, 1]"),
    ("gpu_memory_utilization", -0.1, "(0, 1]"),
    ("gpu_memory_utilization", float("nan"), "(0, 1]"),
    ("gpu_memory_utilization", "0.9", "(0, 1]"),
    ("dtype", "int8", "'float32'"),
    ("dtype", "fp32", "'bfloat16'"),
    ("device", "tpu", "'cuda'"),
    ("device_memory_gb", 0, "> 0"),
    ("device_memory_gb", -1.0, "> 0"),
    ("max_model_len", 0, ">= 1"),
    ("max_model_len", -5, ">= 1"),
    ("max_num_seqs", 0, ">= 1"),
    ("max_num_seqs", 2.5, ">= 1"),
    ("max_num_batched_tokens", 0, ">= 1"),
    ("num_gpu_blocks_override", 0, ">= 1"),
    ("seed", "42", "integer"),
    ("preemption_mode", "drop", "'recompute'"),
    ("long_prefill_token_threshold", -1, ">= 0"),
    ("swap_space", -1, ">= 0"),
])
def test_bad_knob_names_knob_value_and_limit(knob, value, limit):
    with pytest.raises(ValueError) as error:
        EngineConfig(**{knob: value})
    message = str(error.value)
    assert f"{knob}={value!r}" in message
    assert limit in message


@pytest.mark.parametrize("block_size", [1, 2, 16, 32, MAX_BLOCK_SIZE])
def test_every_power_of_two_block_size_is_accepted(block_size):
    assert EngineConfig(block_size=block_size).block_size == block_size


def test_defaults_are_valid_and_vllm_like():
    config = EngineConfig()
    assert (config.block_size, config.gpu_memory_utilization, config.dtype) == (16, 0.9, "auto")
    assert config.model is None


def test_whole_prompt_must_fit_the_budget_without_chunked_prefill():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=64.*max_model_len=128"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128)
    EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=64, max_model_len=128)


def test_with_changes_validates_and_refuses_unknown_knobs():
    config = EngineConfig()
    assert config.with_changes(block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size=3"):
        config.with_changes(block_size=3)
    with pytest.raises(ValueError, match="no_such_knob"):
        config.with_changes(no_such_knob=1)


def test_resolved_fills_lengths_from_the_model_and_caps_max_model_len():
    resolved = EngineConfig().resolved(model_max_len=512)
    assert resolved.max_model_len == 512
    assert resolved.max_num_batched_tokens == 2048
    assert EngineConfig(enable_chunked_prefill=False).resolved(512).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match=r"max_model_len=1024.*max_position_embeddings=512"):
        EngineConfig(max_model_len=1024).resolved(model_max_len=512)


# ---- the engine refuses bad input and keeps serving --------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama").path), dtype="float32", device="cpu",
               device_memory_gb=0.05, max_model_len=64, max_num_batched_tokens=128)


def _assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize(("prompt", "message"), [
    ([], r"prompt: empty"),
    ("", r"prompt: empty"),
    (list(range(1, 65)), r"prompt: 64 tokens.*max_model_len=64"),
    ([1, 2, 300], r"prompt: token ids must be integers in \[0, 256\)"),
    ([1, -1], r"prompt: token ids"),
])
def test_bad_prompt_fails_only_its_own_request(llm, prompt, message):
    engine = llm.engine
    good_before = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    good_after = engine.add_request([4, 5, 6], GREEDY)

    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    assert set(finished) == {good_before.request_id, good_after.request_id}
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())
    _assert_idle(llm)


def test_generate_with_a_bad_prompt_raises_and_leaves_the_engine_clean(llm):
    with pytest.raises(ValueError, match=r"max_model_len=64"):
        llm.generate([[1, 2, 3], list(range(1, 100))], GREEDY, use_tqdm=False)
    _assert_idle(llm)
    outputs = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request([1, 2], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="request_id='same'"):
        engine.add_request([3, 4], GREEDY, request_id="same")
    engine.abort_request("same")
    _assert_idle(llm)


def test_unknown_model_path_names_model(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"model={str(tmp_path / 'nope')!r}")):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path, tiny_model):
    folder = tmp_path / "gpt2"
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model("llama").path / name, folder / name)
    with pytest.raises(ValueError, match=r"model: unsupported architecture.*GPT2LMHeadModel.*"
                                         r"LlamaForCausalLM"):
        LLM(str(folder), device="cpu")


def test_max_model_len_beyond_the_model_names_both_limits(tiny_model):
    with pytest.raises(ValueError, match=r"max_model_len=1000.*max_position_embeddings=256"):
        LLM(str(tiny_model("llama").path), device="cpu", max_model_len=1000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(tiny_model):
    with pytest.raises(ValueError, match="device='cuda'"):
        LLM(str(tiny_model("llama").path), device="cuda")


def test_more_than_one_device_is_refused(tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(str(tiny_model("llama").path), tensor_parallel_size=2)


def test_unknown_knob_is_refused_by_name(tiny_model):
    with pytest.raises((TypeError, ValueError), match="no_such_knob"):
        LLM(str(tiny_model("llama").path), no_such_knob=1)


@pytest.mark.parametrize(("native_bf16", "quantization", "int8_dots", "expected"), [
    (True, "none", False, torch.bfloat16),  # AVX512-BF16 / AMX: bf16 GEMMs in hardware
    (False, "none", True, torch.float32),  # dense weights: bf16 GEMMs would be emulated
    (False, "int4", True, torch.bfloat16),  # packed weights meet VNNI dots on bf16 rows
    (False, "gguf", True, torch.bfloat16),
    (False, "int8", False, torch.float32),  # no VNNI: the exact kernels, fp32 is faster
])
def test_auto_dtype_is_bf16_where_the_linears_run_bf16_fast(monkeypatch, native_bf16,
                                                            quantization, int8_dots, expected):
    from dataclasses import replace

    from kvscope.engine.worker import model_runner
    from kvscope.kernels import cpu_kernels

    monkeypatch.setattr(model_runner, "cpu_has_native_bf16", lambda: native_bf16)
    ops = cpu_kernels.kernel_ops()
    ops = replace(ops, packed=replace(ops.packed, rounds_activations_to_int8=int8_dots))
    cpu = torch.device("cpu")
    assert model_runner.resolve_dtype("auto", cpu, quantization, ops) == expected
    assert model_runner.resolve_dtype("float32", cpu, quantization, ops) == torch.float32


def test_a_quantized_engine_on_auto_runs_the_dtype_its_kernels_are_fastest_in(tiny_model):
    from kvscope.engine.orchestrator.engine_core import EngineCore
    from kvscope.engine.worker.model_runner import cpu_has_native_bf16
    from kvscope.kernels import cpu_kernels

    engine = EngineCore(EngineConfig(model=str(tiny_model("llama").path), device="cpu",
                                     device_memory_gb=0.05, quantization="int4"))
    int8_dots = cpu_kernels.kernel_ops().packed.rounds_activations_to_int8
    assert engine.runner.dtype == (torch.bfloat16 if cpu_has_native_bf16() or int8_dots
                                   else torch.float32)
