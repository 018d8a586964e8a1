"""GGUF mixture-of-experts files as llama.cpp writes them (Qwen3-MoE and Qwen2-MoE: a router
`ffn_gate_inp` and each expert part one 3-D tensor, `ffn_{gate,up,down}_exps`; Qwen2-MoE's
shared expert `ffn_{gate,up,down}_shexp` behind its gate `ffn_gate_inp_shexp`), served as
they ship: the experts' k-quant and Q8_0 blocks stay packed, as the file stores them, and the
fused expert op streams them through the same kernels as the dense GGUF layers; greedy
tokens equal transformers' on the de-quantized weights."""

import numpy as np
import pytest
import torch
from conftest import run_to_completion, transformers_greedy
from gguf import GGMLQuantizationType, quants
from test_gguf_models import GREEDY, PROMPTS, k_quant_model, write_model_gguf

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.gguf_weights import gguf_tensor_bytes_by_type
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models.moe import Experts
from kvscope.engine.worker.models.quantized import GgufLinear
from kvscope.kernels import select_ops
from kvscope.kernels.gguf_blocks import random_blocks

Q = GGMLQuantizationType
# Each layer's expert parts (gate, up, down): the k-quants and Q8_0, a gate and up of
# different types (each expert's gate_up rows then two runs), and of one type.
EXPERT_TYPES = [(Q.Q4_K, Q.Q5_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q4_K)]
# Every layer a MoE layer, as llama.cpp's graphs have them: Qwen3-MoE's top-k weights
# renormalized, Qwen2-MoE's not, with its shared expert at k-quant width.
MOE_SHAPES = {
    "qwen3-moe": {"moe_intermediate_size": 256, "mlp_only_layers": [], "num_hidden_layers": 2,
                  "norm_topk_prob": True},
    "qwen2-moe": {"moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
                  "mlp_only_layers": [], "decoder_sparse_step": 1, "num_hidden_layers": 2,
                  "layer_types": ["full_attention"] * 2,
                  "norm_topk_prob": False},
}
# The routers, kept F16 as llama.cpp's converter keeps them.
ROUTERS = ("gate", "shared_expert_gate")


def k_quant_moe_model(arch: str = "qwen3-moe"):
    """A tiny MoE at k-quant width whose experts are random valid blocks of EXPERT_TYPES,
    its routers F16: (the blocks by transformers name, the experts' parts under
    "...mlp.experts.gate_proj.weight"; transformers' model holding their de-quantized
    values)."""
    blocks, hf_model = k_quant_model(arch, dense=ROUTERS, overrides=MOE_SHAPES[arch])
    config = hf_model.config
    experts, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    rng = np.random.default_rng(63)
    with torch.no_grad():
        for layer, kinds in enumerate(EXPERT_TYPES):
            module = hf_model.model.layers[layer].mlp.experts
            values = {}
            for part, kind in zip(("gate_proj", "up_proj", "down_proj"), kinds):
                out, into = (hidden, width) if part == "down_proj" else (width, hidden)
                rows = random_blocks(kind, experts * out, into, rng)
                blocks[f"model.layers.{layer}.mlp.experts.{part}.weight"] = (
                    kind, rows.reshape(experts, out, -1))
                values[part] = torch.from_numpy(quants.dequantize(rows, kind)).view(experts, out, into)
            module.gate_up_proj.copy_(torch.cat([values["gate_proj"], values["up_proj"]], dim=1))
            module.down_proj.copy_(values["down_proj"])
    return blocks, hf_model


@pytest.fixture(scope="module", params=list(MOE_SHAPES))
def moe_gguf(request, tmp_path_factory):
    """A tiny MoE GGUF's path and transformers' model of its de-quantized weights."""
    blocks, hf_model = k_quant_moe_model(request.param)
    path = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    write_model_gguf(request.param, hf_model, path, blocks=blocks)
    return path, hf_model


def expert_bytes_by_type(path) -> dict[str, int]:
    """The bytes of the file's expert tensors per GGUF type, as stored."""
    from kvscope.engine.worker.gguf_weights import open_gguf

    totals: dict[str, int] = {}
    for tensor in open_gguf(path).tensors:
        if "_exps." in tensor.name:
            totals[tensor.tensor_type.name] = totals.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return totals


@pytest.mark.parametrize("eager", [False, True])
def test_a_moe_gguf_serves_its_expert_blocks_packed(eager, moe_gguf, tmp_path, monkeypatch):
    """The experts are GGUF layers holding the file's blocks, byte for byte per type, never
    widened; the C++ stack (or the eager layers) route and run them through the fused
    expert op, and greedy tokens equal transformers' on the de-quantized weights (fp32)."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    path, hf_model = moe_gguf
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", device_memory_gb=0.05,
                          quantization="gguf", enforce_eager=eager)
    runner = ModelRunner(config)
    assert runner.fused_decoder_stack is not eager
    experts = [module for module in runner.model.modules() if isinstance(module, Experts)]
    assert len(experts) == 2
    held: dict[str, int] = {}
    for module in experts:
        for linear in (module.gate_up_proj, module.down_proj):
            assert isinstance(linear, GgufLinear)
            for kind, size in linear.weight_bytes_by_type().items():
                held[kind] = held.get(kind, 0) + size
    assert held == expert_bytes_by_type(path)
    on_file = gguf_tensor_bytes_by_type(path)
    assert {kind: size for kind, size in runner.weight_bytes_by_type.items() if kind.startswith("Q")} == {
        kind: size for kind, size in on_file.items() if kind.startswith("Q")}
    outputs = run_to_completion(EngineCore(config, runner=runner), PROMPTS, GREEDY).outputs
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(hf_model, PROMPTS, 8)


def test_the_c_stack_runs_gguf_experts_as_the_eager_layers_do(moe_gguf, tmp_path, monkeypatch):
    """bf16 activations: the one-call stack's tokens and log-probabilities are the eager
    layers', bit for bit, for decode steps (the expert blocks streamed, in lanes where the
    kernels repack them) and a prefill past the streaming limit (each chosen expert
    de-quantized for a GEMM)."""
    select_ops(torch.device("cpu"))
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = moe_gguf
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [*PROMPTS, list(range(100, 170))]
    runs = []
    for eager in (False, True):
        config = EngineConfig(model=str(path), dtype="bfloat16", device="cpu",
                              device_memory_gb=0.05, quantization="gguf", enforce_eager=eager)
        outputs = run_to_completion(EngineCore(config), prompts, params).outputs
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert runs[0] == runs[1]


def test_a_gguf_expert_tensor_the_config_does_not_make_is_refused_by_name(tmp_path,
                                                                         monkeypatch):
    """A file whose expert width key disagrees with its expert tensors: the loader names the
    tensor, its rows and what the config makes, before anything decodes."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_moe_model()
    hf_model.config.moe_intermediate_size = 128  # the key written; the tensors keep 256
    path = tmp_path / "qwen3moe.gguf"
    write_model_gguf("qwen3-moe", hf_model, path, blocks=blocks)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", device_memory_gb=0.05)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.experts.gate_proj"
                                         r".weight' has \[2048, 256\] rows x inputs, but the "
                                         r"config .* makes it \[8 x 128, 256\]"):
        ModelRunner(config)
