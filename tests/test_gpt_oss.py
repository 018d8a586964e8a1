"""gpt-oss beyond what every MoE model is tested for (tests/test_moe_models.py runs its greedy
parity through both paths, chunked prefill, preemption, prefix caching and n > 1): its
experts as the hub ships them, in MXFP4, kept packed and matching transformers' de-quantized
model; the attention sinks changing the output; the configs it refuses."""

import pytest
import torch
from conftest import _tiny_config, transformers_greedy
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.models import model_class
from kvscope.engine.worker.models.moe import Mxfp4ExpertsLinear
from kvscope.kernels import mxfp4

PROMPTS = [[5, 17, 99, 3, 250, 8], list(range(40, 70)), [200 - i for i in range(19)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# transformers' own list for gpt-oss's shipped checkpoints: what is not in MXFP4
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_model, tmp_path_factory):
    """The tiny gpt-oss with its experts quantized to MXFP4 in the hub's layout
    (gate_up_proj_blocks [experts, 2 * width, hidden / 32, 16], its scales, down_proj's alike,
    the biases dense; quantization_config.quant_method mxfp4), and transformers' greedy
    tokens on it, de-quantized as transformers loads it on a CPU."""
    tiny = tiny_model("gpt-oss")
    folder = tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")
    state = {name: tensor.contiguous() for name, tensor in tiny.hf_model.state_dict().items()}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers' experts hold [experts, in, out]; MXFP4 rows are outputs
        blocks, scales = mxfp4.quantize(state.pop(name).transpose(1, 2))
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = _tiny_config("gpt-oss")
    config.architectures = ["GptOssForCausalLM"]
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config.save_pretrained(folder)
    for path in tiny.path.iterdir():
        if "token" in path.name:
            (folder / path.name).write_bytes(path.read_bytes())
    reference = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    return folder, transformers_greedy(reference, PROMPTS, MAX_TOKENS), state


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["stack", "eager"])
def test_mxfp4_experts_stay_packed_and_match_transformers(mxfp4_checkpoint, run_engine,
                                                          enforce_eager):
    folder, expected, state = mxfp4_checkpoint
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                     device_memory_gb=0.05, enforce_eager=enforce_eager,
                                     max_num_batched_tokens=16))
    run = run_engine(engine, PROMPTS, GREEDY)
    assert [output.outputs[0].token_ids for output in run.outputs] == expected
    assert engine.runner.fused_decoder_stack is not enforce_eager
    experts = [module for module in engine.runner.model.modules()
               if isinstance(module, Mxfp4ExpertsLinear)]
    assert len(experts) == 4 and all(e.weight.dtype == torch.uint8 for e in experts)
    # The weights in memory are the file's bytes (the fp32 rest, the experts packed).
    file_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert engine.runner.weight_bytes == file_bytes


def test_the_sinks_change_the_output(tiny_model, run_engine, tmp_path):
    """The same checkpoint with every sink far below the scores (so it takes no weight)
    gives other tokens: the sinks are read, and where they matter."""
    tiny = tiny_model("gpt-oss")
    model = AutoModelForCausalLM.from_config(tiny.hf_model.config, dtype=torch.float32).eval()
    model.load_state_dict(tiny.hf_model.state_dict())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    model.save_pretrained(tmp_path)
    for path in tiny.path.iterdir():
        if "token" in path.name:
            (tmp_path / path.name).write_bytes(path.read_bytes())
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05))
    without = [o.outputs[0].token_ids for o in run_engine(engine, PROMPTS, GREEDY).outputs]
    assert without == transformers_greedy(model, PROMPTS, MAX_TOKENS)
    assert without != transformers_greedy(tiny.hf_model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("swiglu_limit", 10.0, r"swiglu_limit=10.0 is not supported .*\[7.0\]"),
    ("swiglu_alpha", 1.0, r"swiglu_alpha=1.0 is not supported .*\[1.702\]"),
    ("quantization_config", {"quant_method": "fp8"},
     r"quant_method='fp8' is not supported .*supported: mxfp4"),
])
def test_a_gpt_oss_config_the_layers_cannot_follow_is_refused_naming_the_field(field, value,
                                                                              named):
    config = _tiny_config("gpt-oss")
    config.architectures = ["GptOssForCausalLM"]
    setattr(config, field, value)
    with pytest.raises(ValueError, match=named):
        model_class(config)


def test_mxfp4_blocks_of_the_wrong_shape_are_refused_naming_the_tensor(mxfp4_checkpoint,
                                                                       tmp_path):
    folder, _, state = mxfp4_checkpoint
    broken = dict(state)
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    broken[name] = broken[name][:, :, :1].contiguous()
    save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[8, 64, 1, 16\], but the config"):
        EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                device_memory_gb=0.05))
