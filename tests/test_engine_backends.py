"""The whole engine on each kernel backend (KVSCOPE_ATTENTION_BACKEND) gives the torch
path's greedy tokens."""

import importlib.util

import pytest
import torch
from torch import nn

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models.decoder_stack import FusedDecoderStack
from kvscope.engine.worker.models.layers import Embedding
from kvscope.engine.worker.models.llama import LayerKind
from kvscope.kernels import cpu_kernels, reference

# Prompts that end mid-block, exactly on a block, and span several blocks, run as a mix of
# chunked prefills (budget 24) and decodes.
PROMPTS = [[5, 9, 13], list(range(1, 9)), list(range(40, 61))]


def runner_for(monkeypatch, tiny_model, backend: str, arch: str = "llama", **knobs):
    """A runner of its own (the backend is chosen when a runner starts) on a tiny model."""
    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", backend)
    config = EngineConfig(model=str(tiny_model(arch).path), device="cpu", device_memory_gb=0.05,
                          block_size=8, max_num_batched_tokens=24,
                          **{"dtype": "float32", **knobs})
    runner = ModelRunner(config)
    assert runner.kernel_ops.backend == backend
    return config, runner


def greedy_tokens(monkeypatch, tiny_model, run_engine, backend: str, arch: str = "llama",
                  **knobs) -> list[list[int]]:
    config, runner = runner_for(monkeypatch, tiny_model, backend, arch, **knobs)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_engine(EngineCore(config, runner=runner), PROMPTS, params).outputs
    return [o.outputs[0].token_ids for o in outputs]


# The eager layers through each backend's ops: llama3 rope scaling and tied embeddings
# (llama3, Llama 3.2), per-head q/k norms (qwen3), a NoPE layer (smollm3), partial rotary
# (phi3), a sliding window of 8 whose blocks the KV manager frees
# (mistral-window), a window with soft-capped scores (gemma2), post-norms and a rope per
# layer type (olmo3), position-scaled queries (ministral3) and layers of two K/V shapes
# reading their part of each pool slot through its strides (gemma4) included.
EAGER_ARCHITECTURES = ["llama", "llama3", "qwen3", "smollm3", "phi3", "mistral-window", "gemma2",
                       "olmo3", "ministral3", "gemma4"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed")
@pytest.mark.parametrize("arch", EAGER_ARCHITECTURES)
def test_triton_backend_gives_the_same_greedy_tokens(tiny_model, run_engine, monkeypatch, arch):
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch", arch)
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "triton", arch) == expected


@pytest.mark.parametrize("arch", EAGER_ARCHITECTURES)
def test_cpu_backend_gives_the_same_greedy_tokens(tiny_model, run_engine, monkeypatch, arch):
    """The C++ attention and small fused ops against the plain-torch path, end to end."""
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch", arch)
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "cpu", arch,
                         enforce_eager=True) == expected


# qwen2: qkv biases, tied embeddings; llama3: llama3 rope scaling, tied embeddings; qwen3:
# q/k norms; smollm3: a NoPE layer; phi3: fused checkpoint projections, partial rotary, LongRoPE;
# olmo3: post-norms, q/k norms over whole projections, a rope per layer type; ministral3:
# queries scaled by position
STACK_ARCHITECTURES = ["llama", "qwen2", "llama3", "qwen3", "smollm3", "phi3", "olmo3",
                       "ministral3"]
# gemma3: two rope bases, sliding and global layers, (1 + weight) q/k norms, GeGLU; gemma2:
# soft-capped scores and logits (their eager layers compute those in plain torch, so the
# stack matches them to fp32 rounding, below, rather than bit for bit)
GEMMA_ARCHITECTURES = ["gemma3", "gemma2"]


@pytest.mark.parametrize("arch", STACK_ARCHITECTURES + GEMMA_ARCHITECTURES)
def test_the_one_call_decoder_stack_gives_the_eager_layers_greedy_tokens(
        tiny_model, run_engine, monkeypatch, arch):
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "cpu", arch,
                             enforce_eager=True)
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "cpu", arch) == expected


@pytest.mark.parametrize(("quantization", "prepack"), [("none", False), ("none", True), ("int8", False),
                                                     ("int4", False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", STACK_ARCHITECTURES)
def test_the_decoder_stack_computes_what_the_layers_compute(tiny_model, monkeypatch, dtype,
                                                            quantization, prepack, arch):
    """Same C++ ops in the same order: equal outputs, logits and K/V written, for ragged
    batches of prefill chunks and decodes (17 rows stream the dense weights, 34 take the
    GEMM; packed weights past their kernels' rows de-quantize first) and for decode batches
    (one row, and 3 rows, stream the dense or packed weights through the kernels)."""
    _, runner = runner_for(monkeypatch, tiny_model, "cpu", arch, dtype=dtype,
                           quantization=quantization, prepack_weights=prepack)
    # bf16 weights prepacked (where the kernels take tiles: AVX512-BF16): the stack and the
    # layers both run the tiles
    prepack_weight = runner.kernel_ops.prepack_weight
    probe = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    prepacks = prepack_weight is not None and prepack_weight(probe) is not None
    assert any(getattr(m, "prepacked", None) is not None for m in runner.model.modules()) == (
        prepack and dtype == "bfloat16" and prepacks)
    for fused, eager in stack_and_layers(runner):
        for stack_tensor, layers_tensor in zip(fused, eager, strict=True):
            assert torch.equal(stack_tensor, layers_tensor)


def stack_and_layers(runner):
    """For a ragged batch of prefill chunks and decodes (17 rows), a decode of one row, one of
    three rows and a batch past the streaming kernels' 32 rows (GEMM): (final norm, logits,
    KV cache) through the stack, then through the layers. Each KV cache group has blocks of
    its own (a sequence's table interleaves them)."""
    assert runner.fused_decoder_stack
    groups = len(runner.kv_groups)
    runner.allocate_kv_cache(8, 8 * groups)
    model = runner.model
    for pieces in ([(0, 11, [0, 1]), (7, 8, [2]), (16, 21, [3, 4, 5])],
                   [(11, 12, [0, 1])], [(11, 12, [0, 1]), (8, 9, [2, 6]), (21, 22, [3, 4, 5])],
                   [(0, 33, [0, 1, 2, 3, 4]), (7, 8, [5])]):
        pieces = [(start, end, [block * groups + group for block in table
                                for group in range(groups)]) for start, end, table in pieces]
        inputs = runner._flat_inputs(pieces, 8, token_ids=lambda i, start, end: list(
            range(start + 3, end + 3)))
        with torch.inference_mode():
            fused = model(*inputs)
            fused_logits = model.compute_logits(fused)
            fused_cache = runner.kv_cache.clone()
            stack, model.decoder_stack = model.decoder_stack, None
            eager = model(*inputs)
            eager_logits = model.compute_logits(eager)
            model.decoder_stack = stack
        assert fused_logits.dtype == torch.float32
        yield (fused, fused_logits, fused_cache), (eager, eager_logits, runner.kv_cache)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("arch", GEMMA_ARCHITECTURES)
def test_the_decoder_stack_computes_what_gemma_layers_compute(tiny_model, monkeypatch,
                                                              quantization, arch):
    """Gemma's layers compute their (1 + weight) norms, GeGLU and soft caps in plain torch,
    the stack in C++ (fp32 throughout: equal up to summation order and tanh's last bits)."""
    _, runner = runner_for(monkeypatch, tiny_model, "cpu", arch, quantization=quantization)
    for fused, eager in stack_and_layers(runner):
        for stack_tensor, layers_tensor in zip(fused, eager, strict=True):
            torch.testing.assert_close(stack_tensor, layers_tensor, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prepack_weights_unset_follows_the_cpu_and_the_tiles_move_with_their_weight(
        tiny_model, monkeypatch, arch):
    """prepack_weights unset: bf16 weights are prepacked wherever the blocked kernel streams
    the tiles (kvscope's own on AVX512-BF16 without AMX, oneDNN's on AMX), and stay plain
    elsewhere and under False. A prepacked linear's tiles are its weight parameter; kvscope's
    own move to huge pages with the rest of the model, so the kernels read the moved memory,
    not a copy left behind (oneDNN's stay where oneDNN put them). Its forward equals the
    plain weight's to bf16 rounding. The output projection is prepacked too: an untied
    lm_head (llama), or the embedding it is tied to (qwen2), whose lookup reads the tiles and
    gives the plain table's rows exactly."""
    _, plain = runner_for(monkeypatch, tiny_model, "cpu", arch, dtype="bfloat16",
                          prepack_weights=False)
    _, unset = runner_for(monkeypatch, tiny_model, "cpu", arch, dtype="bfloat16")
    amx = cpu_kernels.onednn_uses_amx()
    assert unset.kernel_ops.prepacks_by_default == (torch.ops.kvscope.has_blocked_linear() and (
        torch.ops.kvscope.has_amx_linear() or not amx))
    prepacked = {name: module for name, module in unset.model.named_modules()
                 if getattr(module, "prepacked", None) is not None}
    assert bool(prepacked) == unset.kernel_ops.prepacks_by_default
    if prepacked:
        assert ("model.embed_tokens" in prepacked) == unset.model.tied
        assert ("lm_head" in prepacked) == (not unset.model.tied)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():  # through the C++ stack's head
        torch.testing.assert_close(unset.model.compute_logits(hidden),
                                   plain.model.compute_logits(hidden), atol=2e-2, rtol=2e-2)
    assert not any(getattr(m, "prepacked", None) is not None for m in plain.model.modules())
    plain_modules = dict(plain.model.named_modules())
    tile = cpu_kernels.AMX_TILE_OUTPUTS if amx else cpu_kernels.WIDE_TILE_OUTPUTS
    for name, module in prepacked.items():
        assert (module.prepacked.onednn is not None) == amx
        out_features, in_features = plain_modules[name].weight.shape
        assert module.prepacked.blocks.shape == (out_features // tile, tile * in_features)
        if not amx:
            module.weight.data = module.weight.data.clone()  # as huge_pages.move_module moves it
            assert module.prepacked.blocks.data_ptr() == module.weight.data_ptr()
        weight = plain_modules[name].weight
        assert torch.equal(reference.blocked_to_plain(module.weight, *weight.shape), weight)
        if isinstance(module, Embedding):
            ids = torch.tensor([[0, 255, 64], [63, 65, 7]])
            assert torch.equal(module(ids), plain_modules[name](ids))
            continue
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
        torch.testing.assert_close(module(x).float(), plain_modules[name](x).float(),
                                   atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="prepack_weights"):
        EngineConfig(prepack_weights="yes")


def test_enforce_eager_or_the_torch_kernels_keep_the_layers(tiny_model, monkeypatch):
    _, eager = runner_for(monkeypatch, tiny_model, "cpu", enforce_eager=True)
    _, torch_backend = runner_for(monkeypatch, tiny_model, "torch")
    for runner in (eager, torch_backend):
        assert not runner.fused_decoder_stack and runner.model.decoder_stack is None
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def test_the_decoder_stack_names_a_layer_tensor_it_lacks_or_does_not_know(tiny_model, monkeypatch):
    """The C++ stack reads each layer's tensors by their parameter names: a missing one is
    refused with its name, and so is one it would silently ignore."""
    _, runner = runner_for(monkeypatch, tiny_model, "cpu")
    model = runner.model
    layer = model.model.layers[1]
    layer.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    with pytest.raises(RuntimeError, match="does not know: 'extra'"):
        FusedDecoderStack(model, torch.float32)
    del layer.extra
    weight, layer.mlp.down_proj.weight = layer.mlp.down_proj.weight, None
    with pytest.raises(RuntimeError, match="a layer has no 'mlp.down_proj.weight'"):
        FusedDecoderStack(model, torch.float32)
    layer.mlp.down_proj.weight = weight
    FusedDecoderStack(model, torch.float32)  # whole again: builds
    # A per-layer option the stack does not know (a feature it would leave out) is refused.
    monkeypatch.setattr(LayerKind, "stack_options", lambda kind: {"rotary": 1, "window": 4})
    with pytest.raises(RuntimeError, match="does not know: 'window'"):
        FusedDecoderStack(model, torch.float32)


@pytest.mark.parametrize("backend", [
    "cpu",
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="triton is not installed")),
])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_every_backend_decodes_a_quantized_cache_as_the_torch_path(
        tiny_model, run_engine, monkeypatch, backend, kv_cache_dtype):
    """Every backend stores the same codes and scales (bit for bit) and attends over them
    alike (the Triton kernels in the interpreter where there is no GPU)."""
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch",
                             kv_cache_dtype=kv_cache_dtype)
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, backend,
                         kv_cache_dtype=kv_cache_dtype) == expected


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("arch", EAGER_ARCHITECTURES)
def test_triton_backend_runs_quantized_weights_as_the_torch_path(
        tiny_model, run_engine, monkeypatch, arch, quantization):
    """int4 / int8 weights on the Triton backend (de-quantized per forward, as on the torch
    backend, with Triton's attention and KV stores) for every architecture."""
    expected = greedy_tokens(monkeypatch, tiny_model, run_engine, "torch", arch,
                             quantization=quantization)
    assert greedy_tokens(monkeypatch, tiny_model, run_engine, "triton", arch,
                         quantization=quantization) == expected
