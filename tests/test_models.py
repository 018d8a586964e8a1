"""What the model code reads from a config: LongRoPE's factors for max_model_len, and the
refusals (architecture, vision, rope type) that name what is not supported (MoE configs':
test_moe_models.py)."""

import pytest
import torch
from conftest import TINY_MAX_POSITIONS, TINY_VOCAB_SIZE, phi3_rope
from transformers import LlamaConfig, LlavaConfig, Phi3Config, Qwen3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models import MODEL_REGISTRY, model_class
from kvscope.engine.worker.models.llama import (
    SUPPORTED_ROPE_TYPES,
    LlamaForCausalLM,
    RotaryTable,
)

SMALL = {"vocab_size": TINY_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": TINY_MAX_POSITIONS}


def test_longrope_takes_the_long_factors_only_when_max_model_len_passes_the_original():
    """As vLLM: one choice for the engine's life, by max_model_len; each equals the table
    transformers computes for a sequence of that length (attention factor included)."""
    original = 64
    config = Phi3Config(**SMALL, **phi3_rope(SMALL, original))
    hf_rotary = Phi3RotaryEmbedding(config)
    x = torch.empty(0, dtype=torch.float32)
    for max_model_len in (original, TINY_MAX_POSITIONS):
        table = RotaryTable(config, TINY_MAX_POSITIONS, max_model_len)
        with torch.inference_mode():
            cos, sin = hf_rotary(x, torch.arange(max_model_len).unsqueeze(0))
        assert table.cos.shape == (TINY_MAX_POSITIONS, 12)  # 3/4 of a 16-wide head
        torch.testing.assert_close(table.cos[:max_model_len], cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(table.sin[:max_model_len], sin[0], rtol=0, atol=1e-6)
    short = RotaryTable(config, TINY_MAX_POSITIONS, original)
    long = RotaryTable(config, TINY_MAX_POSITIONS, original + 1)
    assert not torch.allclose(short.cos, long.cos)


@pytest.mark.parametrize(("config", "named"), [
    (LlavaConfig(architectures=["LlavaForConditionalGeneration"]), "vision inputs"),
    (LlamaConfig(**SMALL, architectures=["FalconForCausalLM"]),
     "unsupported architecture \\['FalconForCausalLM'\\]"),
])
def test_unsupported_models_are_refused_naming_what_and_listing_the_supported(config, named):
    with pytest.raises(ValueError, match=named) as refused:
        model_class(config)
    assert all(name in str(refused.value) for name in MODEL_REGISTRY)


def copy_tokenizer(tiny, folder) -> None:
    for path in tiny.path.iterdir():
        if "token" in path.name:
            (folder / path.name).write_bytes(path.read_bytes())


def test_an_unknown_rope_type_is_refused_at_load(tiny_model, tmp_path):
    """Through the real loader: a rope type whose table depends on each forward's length is
    named, with the supported ones, before any weight is read."""
    config = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"],
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config.save_pretrained(tmp_path)
    copy_tokenizer(tiny_model("llama"), tmp_path)
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported") as refused:
        ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                 device_memory_gb=0.05))
    assert str(list(SUPPORTED_ROPE_TYPES)) in str(refused.value)


def test_a_sharded_safetensors_folder_loads_every_shard(tiny_model, tmp_path, run_engine):
    """Checkpoints of several shards (model-0000x-of-0000y.safetensors and their index)
    load as one: greedy tokens equal transformers'."""
    tiny = tiny_model("qwen3")
    tiny.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    copy_tokenizer(tiny, tmp_path)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    engine = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                     device_memory_gb=0.05))
    prompt = [3, 14, 15, 92, 65]
    output = run_engine(engine, [prompt], SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True)).outputs[0]
    with torch.inference_mode():
        expected = tiny.hf_model.generate(torch.tensor([prompt]), max_new_tokens=6,
                                          min_new_tokens=6, do_sample=False)
    assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize(("change", "named"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
])
def test_a_llama_family_config_the_layers_cannot_run_is_refused_naming_it(change, named):
    config = LlamaConfig(**SMALL, **change)
    with pytest.raises(ValueError, match=f"{named} is not supported; supported: "):
        LlamaForCausalLM(config, TINY_MAX_POSITIONS, TINY_MAX_POSITIONS)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
], ids=lambda scaling: scaling["rope_type"])
def test_the_rotary_table_equals_transformers_for_each_static_rope_type(rope_scaling):
    """Qwen3 with YaRN (its long-context setting), Llama 3.x's llama3, linear."""
    config = Qwen3Config(**SMALL, head_dim=32, rope_scaling={"rope_theta": 1e6, **rope_scaling})
    table = RotaryTable(config, TINY_MAX_POSITIONS, TINY_MAX_POSITIONS)
    with torch.inference_mode():
        cos, sin = Qwen3RotaryEmbedding(config)(torch.empty(0, dtype=torch.float32),
                                               torch.arange(TINY_MAX_POSITIONS).unsqueeze(0))
    torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin, sin[0], rtol=0, atol=1e-6)
