"""A GGUF of each architecture, written with the gguf package under llama.cpp's tensor
names and metadata keys, loads through the real loader: its config (head size, partial
rotary, LongRoPE) survives the conversion, and its tensors land in the right places."""

import numpy as np
import pytest
import torch
from conftest import run_to_completion, transformers_greedy
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.engine_core import EngineCore
from kvscope.engine.sample.sampling_params import SamplingParams
from kvscope.kernels import select_ops

# The tiny models' architectures -> llama.cpp's (Llama 3.2 is a llama GGUF with rope_freqs).
GGUF_ARCH = {"llama": MODEL_ARCH.LLAMA, "llama3": MODEL_ARCH.LLAMA, "qwen3": MODEL_ARCH.QWEN3,
             "phi3": MODEL_ARCH.PHI3}
PROMPTS = [[5, 17, 200, 31, 9], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each Llama Q / K head's rotary halves."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_model_gguf(arch: str, hf_model, path, kind=GGMLQuantizationType.F32) -> None:
    """hf_model as llama.cpp's converter writes it (names from the gguf package's own map)."""
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rotary = config.rope_parameters
    writer.add_rope_freq_base(rotary["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rotary.get("partial_rotary_factor", 1.0)))
    if rotary.get("rope_type") == "llama3":  # as llama.cpp: each rotated pair's divisor
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
        default = 1.0 / rotary["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        writer.add_tensor("rope_freqs.weight", (default / scaled).numpy())
    if rotary.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rotary["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(ROPE_INIT_FUNCTIONS["longrope"](config)[1])
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight",
                              np.array(rotary[f"{which}_factor"], dtype=np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_pad_token_id(0)
    names = get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.numpy()
        if GGUF_ARCH[arch] == MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = llama_cpp_permute(values, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if values.ndim == 2 and kind != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model: str, quantization: str = "none") -> list[list[int]]:
    engine = EngineCore(EngineConfig(model=model, dtype="float32", device="cpu",
                                     device_memory_gb=0.05, quantization=quantization))
    return [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS, GREEDY).outputs]


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_a_gguf_of_each_architecture_gives_transformers_greedy_tokens(
        arch, tiny_model, tmp_path, monkeypatch):
    """Lossless (F32) tensors: the conversion's config and weights are the model's own, so
    the engine's tokens equal transformers' on the original; quantized, the file's tensors
    read block by block under their llama.cpp names give the folder's int8 tokens."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))  # the conversions
    tiny = tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_model_gguf(arch, tiny.hf_model, path)
    assert greedy(str(path)) == transformers_greedy(tiny.hf_model, PROMPTS, 8)
    assert greedy(str(path), "int8") == greedy(str(tiny.path), "int8")


def test_gguf_architectures_and_types_kvscope_does_not_read_are_refused_by_name(tiny_model,
                                                                               tmp_path):
    """A k-quant tensor is named, not de-quantized to fp32 behind the user's back; an
    architecture without a reader is named with the supported ones."""
    tiny = tiny_model("qwen3")
    q5 = tmp_path / "q5.gguf"
    write_model_gguf("qwen3", tiny.hf_model, q5, GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match=r"'token_embd.weight' is Q5_0, which kvscope does "
                                         r"not read; supported GGUF types: \['BF16', 'F16'"):
        greedy(str(q5))
    other = tmp_path / "gemma.gguf"
    writer = GGUFWriter(other, "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma' is not supported; "
                                         r"supported: \['llama', 'qwen2', 'qwen3', 'phi3'\]"):
        greedy(str(other))
