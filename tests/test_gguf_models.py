"""A GGUF of each architecture, written with the gguf package under llama.cpp's tensor
names and metadata keys, loads through the real loader: its config (head size, partial
rotary, LongRoPE) survives the conversion, and its tensors land in the right places; with
quantization="gguf" its k-quant blocks are served as the file stores them."""

import os

import conftest
import numpy as np
import pytest
import torch
from conftest import run_to_completion, transformers_greedy
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
    quants,
)
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker import loader
from kvscope.engine.worker.gguf_weights import gguf_tensor_bytes_by_type, open_gguf
from kvscope.engine.worker.loader import load_tokenizer, resolve_model_path
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models.quantized import GgufLinear
from kvscope.kernels import select_ops
from kvscope.kernels.gguf_blocks import random_blocks

# The tiny models' architectures -> llama.cpp's (Llama 3.2 is a llama GGUF with rope_freqs).
GGUF_ARCH = {"llama": MODEL_ARCH.LLAMA, "llama3": MODEL_ARCH.LLAMA, "qwen3": MODEL_ARCH.QWEN3,
             "phi3": MODEL_ARCH.PHI3, "qwen2": MODEL_ARCH.QWEN2, "smollm3": MODEL_ARCH.SMOLLM3,
             "qwen3-moe": MODEL_ARCH.QWEN3MOE, "qwen2-moe": MODEL_ARCH.QWEN2MOE}
# llama.cpp's converter permutes these architectures' Q / K rows (SmolLM3 is written as a Llama).
PERMUTED_ARCH = (MODEL_ARCH.LLAMA, MODEL_ARCH.SMOLLM3)
CHAT_TEMPLATE = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"
PROMPTS = [[5, 17, 200, 31, 9], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
Q = GGMLQuantizationType


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each Llama Q / K head's rotary halves."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_model_gguf(arch: str, hf_model, path, kind=GGMLQuantizationType.F32,
                     blocks: dict | None = None, rope_scaling: RopeScalingType | None = None) -> None:
    """hf_model as llama.cpp's converter writes it (names from the gguf package's own map);
    `blocks`: {transformers name: (type, rows of blocks)} written as they are instead (a MoE
    layer's experts as one tensor per part, "...mlp.experts.gate_proj.weight" [experts,
    width, row bytes], in place of transformers' fused ones); `rope_scaling`: a
    rope.scaling.type key beside the model's own rotary."""
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
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
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
    if rope_scaling is not None:
        writer.add_rope_scaling_type(rope_scaling)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    tensors = {name: tensor.numpy() for name, tensor in hf_model.state_dict().items()
               if ".mlp.experts." not in name}
    tensors.update({name: None for name in blocks or {} if name not in tensors})
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor_kind, values = (blocks or {}).get(name, (kind, tensor))
        if GGUF_ARCH[arch] in PERMUTED_ARCH and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = llama_cpp_permute(values, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name in (blocks or {}):
            writer.add_tensor(gguf_name, values, raw_dtype=tensor_kind)
        elif values.ndim == 2 and kind != GGMLQuantizationType.F32:
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


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen3", "phi3", "smollm3"])
def test_a_gguf_of_each_architecture_gives_transformers_greedy_tokens(
        arch, tiny_model, tmp_path, monkeypatch):
    """Lossless (F32) tensors: the conversion's config and weights are the model's own, so
    the engine's tokens equal transformers' on the original; quantized, the file's tensors
    read block by block under their llama.cpp names give the folder's int8 tokens. The
    file's chat template is the model's. (SmolLM3, which transformers' GGUF reader does not
    know, has its config built from llama.cpp's keys and its fp32 folder from the tensors.)"""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))  # the conversions
    tiny = tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_model_gguf(arch, tiny.hf_model, path)
    assert greedy(str(path)) == transformers_greedy(tiny.hf_model, PROMPTS, 8)
    assert greedy(str(path), "int8") == greedy(str(tiny.path), "int8")
    assert load_tokenizer(resolve_model_path(str(path))).chat_template == CHAT_TEMPLATE


# Q4_K_M's mix, as llama.cpp's quantizer makes it: most projections Q4_K, some Q6_K
# (attn_v, ffn_down, the output), the rest of the types once each; a tensor whose inputs are
# no multiple of 256 falls back to a 32-weight type, as llama.cpp's does.
K_QUANT_MIX = {"q_proj": Q.Q4_K, "k_proj": Q.Q5_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K,
               "qkv_proj": Q.Q4_K, "gate_proj": Q.Q5_0, "up_proj": Q.Q4_K, "gate_up_proj": Q.Q5_K,
               "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0, "lm_head": Q.Q6_K}
FALLBACK = {0: Q.Q4_1, 1: Q.Q4_0, 2: Q.Q5_1}


def k_quant_model(arch: str, dense: tuple[str, ...] = (), overrides: dict | None = None):
    """A tiny model at k-quant width (inputs of 256 and 512) whose every matrix is made of
    random valid blocks in the K_QUANT_MIX type, or stored F16 where its module's name is in
    `dense`: (the blocks, transformers' model holding their de-quantized values).
    `overrides`: config fields beside those widths."""
    config = conftest._tiny_config(arch)
    config = config.__class__.from_dict({**config.to_dict(), "hidden_size": 256,
                                         "intermediate_size": 512, "num_attention_heads": 16,
                                         **(overrides or {})})
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    blocks = {}
    with torch.no_grad():
        for index, (name, parameter) in enumerate(hf_model.named_parameters()):
            if "norm" in name and arch in conftest.RANDOM_NORM_ARCHITECTURES:
                parameter.uniform_(0.5, 1.5)
            if parameter.dim() != 2:
                continue
            module = name.split(".")[-2]
            kind = Q.F16 if module in dense else K_QUANT_MIX[module]
            if parameter.shape[1] % 256 and kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                kind = FALLBACK[index % 3]
            rows = (parameter.numpy().astype(np.float16) if kind == Q.F16
                    else random_blocks(kind, parameter.shape[0], parameter.shape[1], rng))
            blocks[name] = (kind, rows)
            parameter.copy_(torch.from_numpy(quants.dequantize(rows, kind)))
    return blocks, hf_model


# The mixtures of experts have their expert tensors made and checked in test_gguf_moe.py.
@pytest.mark.parametrize("arch", [arch for arch in GGUF_ARCH if not arch.endswith("-moe")])
def test_a_k_quant_gguf_of_each_architecture_serves_its_blocks_as_stored(arch, tmp_path,
                                                                         monkeypatch):
    """quantization="gguf": the file's blocks are the weights (their bytes per type are the
    file's, no fp32 folder is written) and greedy tokens equal transformers' on the
    de-quantized weights, fp32 activations."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_model_gguf(arch, hf_model, path, blocks=blocks)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", device_memory_gb=0.05,
                          quantization="gguf")
    runner = ModelRunner(config)
    assert runner.fused_decoder_stack  # the blocks run in the one-call C++ stack
    on_file = gguf_tensor_bytes_by_type(path)
    assert {kind: size for kind, size in runner.weight_bytes_by_type.items() if kind.startswith("Q")} == {
        kind: size for kind, size in on_file.items() if kind.startswith("Q")}
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no converted weights
    outputs = run_to_completion(EngineCore(config, runner=runner), PROMPTS, GREEDY).outputs
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(hf_model, PROMPTS, 8)


def test_a_gguf_file_is_served_as_it_ships_without_the_quantization_knob(tmp_path, monkeypatch):
    """quantization unset: a .gguf model is "gguf" (vLLM infers it from the file too), so
    its weights take the file's block bytes, not a de-quantized copy; an explicit "none"
    is kept (it de-quantizes), and a folder's unset quantization is "none"."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model("qwen3")
    path = tmp_path / "qwen3.gguf"
    write_model_gguf("qwen3", hf_model, path, blocks=blocks)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", device_memory_gb=0.05)
    assert config.quantization == "gguf"
    held = ModelRunner(config).weight_bytes_by_type
    on_file = gguf_tensor_bytes_by_type(path)
    assert {kind: size for kind, size in held.items() if kind.startswith("Q")} == {
        kind: size for kind, size in on_file.items() if kind.startswith("Q")}
    assert held["float32"] == on_file["F32"]  # the norms: no block was widened
    assert EngineConfig(model=str(path), quantization="none").quantization == "none"
    assert EngineConfig(model=str(tmp_path)).quantization == "none"


def test_a_missing_gguf_file_is_refused_by_name(tmp_path):
    """quantization="gguf" with no file at `model`: an error naming it, not a TypeError from
    deep in the reader."""
    missing = tmp_path / "missing.gguf"
    config = EngineConfig(model=str(missing), dtype="float32", device="cpu", device_memory_gb=0.05,
                          quantization="gguf")
    with pytest.raises(ValueError, match=rf"model='{missing}': no such file; quantization='gguf'"):
        ModelRunner(config)


def test_the_engine_reads_a_gguf_as_the_gguf_package_does(tmp_path):
    """open_gguf's reader (slicing a plain view of the memory map) finds the same fields,
    values and tensor bytes as the gguf package's own reader."""
    blocks, hf_model = k_quant_model("qwen3")
    path = tmp_path / "qwen3.gguf"
    write_model_gguf("qwen3", hf_model, path, blocks=blocks)
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types
        assert repr(ours.fields[name].contents()) == repr(field.contents()), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert np.array_equal(mine.data, reference.data), mine.name


def test_a_gguf_metadata_is_converted_once_per_version_of_the_file(tmp_path, monkeypatch):
    """quantization="gguf" converts the file's config and tokenizer from its metadata once,
    into a folder under the cache named by the file's size and mtime: a second load takes
    them from there (the conversions do not run again) and gets the same config, chat
    template and tokens; a rewritten file gets a folder of its own."""
    select_ops(torch.device("cpu"))  # the C++ kernels' build stays in the usual cache
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model("llama")
    path = tmp_path / "llama.gguf"
    write_model_gguf("llama", hf_model, path, blocks=blocks)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", device_memory_gb=0.05,
                          quantization="gguf")
    first = ModelRunner(config)
    metadata = tmp_path / "cache" / "gguf-metadata"
    assert len(list(metadata.iterdir())) == 1

    def converted_again(*args, **kwargs):
        raise AssertionError("the GGUF's metadata was converted again")

    with monkeypatch.context() as patch:
        patch.setattr(loader, "gguf_config", converted_again)
        patch.setattr(loader, "load_gguf_tokenizer", converted_again)
        second = ModelRunner(config)
    assert second.hf_config.to_dict() == first.hf_config.to_dict()
    assert second.tokenizer.chat_template == CHAT_TEMPLATE
    outputs = run_to_completion(EngineCore(config, runner=second), PROMPTS, GREEDY).outputs
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(hf_model, PROMPTS, 8)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    ModelRunner(config)
    assert len(list(metadata.iterdir())) == 2


# F16 rows among the blocks: K between Q and V's blocks in the merged QKV projection, the
# gate and up projections one dense run, the down projection wholly dense.
DENSE_MODULES = ("k_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("arch, dense", [("llama", ()), ("qwen3", ()), ("llama", DENSE_MODULES)])
def test_the_c_stack_runs_gguf_blocks_as_the_eager_layers_do(arch, dense, tmp_path, monkeypatch):
    """bf16 activations (rounded to int8 for the blocks' integer dots): the one-call C++
    stack's tokens and log-probabilities are the eager layers', bit for bit, for decode
    batches (rows streamed through the blocks) and prefills past the streaming limit (the
    blocks de-quantized for a GEMM), with a Q8_0 embedding and a Q6_K output projection,
    and with F16 rows beside the blocks. Where the kernels stream a type faster repacked
    (gguf_repacked_type), both run its lanes; a model held wholly in lanes streams steps of
    up to 64 rows, one with F16 rows 32, in the stack as in the eager layers."""
    select_ops(torch.device("cpu"))
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model(arch, dense)
    path = tmp_path / f"{arch}.gguf"
    write_model_gguf(arch, hf_model, path, blocks=blocks)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    # 105 prompt rows: a first step past every streaming limit, or (a 48-token budget)
    # steps of 48 rows, between int4's and int8's limit and the lanes' (64).
    prompts = [*PROMPTS, list(range(100, 170))]
    for budget in (None, 48):
        runs = []
        for eager in (False, True):
            config = EngineConfig(model=str(path), dtype="bfloat16", device="cpu",
                                  device_memory_gb=0.05, quantization="gguf",
                                  enforce_eager=eager, max_num_batched_tokens=budget)
            runner = ModelRunner(config)
            assert runner.fused_decoder_stack is not eager
            repacked = runner.kernel_ops.packed.gguf_repacked_type
            modules = [module for module in runner.model.modules()
                       if isinstance(module, GgufLinear)]
            parts = [part for module in modules for part in module.parts if part.kind is not None]
            assert Q.Q4_K in {part.kind for part in parts}
            for part in parts:
                code = repacked(int(part.kind), torch.bfloat16)
                assert part.code == (int(part.kind) if code == -1 else code)
            in_lanes = all(module.in_lanes() for module in modules)
            assert all(module.model_in_lanes == in_lanes for module in modules)
            outputs = run_to_completion(EngineCore(config, runner=runner), prompts, params).outputs
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
        assert runs[0] == runs[1], budget


@pytest.mark.parametrize("eager", [False, True])
def test_f16_rows_of_a_gguf_decode_through_the_streaming_dense_kernel(eager, tmp_path,
                                                                     monkeypatch):
    """A decode step streams a GGUF's F16 rows through the dense kernel, as a folder's
    bf16 weights are, in the stack and eager: a GEMM there reorders the weight every call
    and ran an F16 file's single stream at half the bandwidth (docs/performance-history.md,
    'On Zen 4')."""
    select_ops(torch.device("cpu"))
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model("llama", DENSE_MODULES)
    path = tmp_path / "llama.gguf"
    write_model_gguf("llama", hf_model, path, blocks=blocks)
    engine = EngineCore(EngineConfig(model=str(path), dtype="bfloat16", device="cpu",
                                     device_memory_gb=0.05, quantization="gguf",
                                     enforce_eager=eager))
    engine.add_request(PROMPTS[1], GREEDY)
    engine.step()  # the prefill
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        engine.step()
    ops = {event.key for event in profiler.key_averages()}
    assert "kvscope::linear_small_batch" in ops
    assert not ops & {"aten::mm", "aten::addmm", "aten::linear"}


def test_k_quant_blocks_through_the_triton_backend_give_the_same_tokens(tmp_path, monkeypatch):
    """The Triton backend (in the interpreter here) de-quantizes the blocks and runs a GEMM."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    blocks, hf_model = k_quant_model("llama")
    path = tmp_path / "llama.gguf"
    write_model_gguf("llama", hf_model, path, blocks=blocks)
    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", "triton")
    assert greedy(str(path), "gguf") == transformers_greedy(hf_model, PROMPTS, 8)


def test_gguf_architectures_and_types_kvscope_does_not_read_are_refused_by_name(tiny_model,
                                                                               tmp_path):
    """A tensor type without a kernel (IQ*, TQ*, MXFP4...) is named, not de-quantized to
    fp32 behind the user's back; an architecture without a reader is named with the
    supported ones."""
    tiny = tiny_model("qwen3")
    mxfp4 = tmp_path / "mxfp4.gguf"
    write_model_gguf("qwen3", tiny.hf_model, mxfp4, GGMLQuantizationType.MXFP4)
    for quantization in ("none", "gguf"):
        with pytest.raises(ValueError, match=r"'token_embd.weight' is MXFP4, which kvscope does "
                                             r"not read; supported GGUF types: \['BF16', 'F16', "
                                             r"'F32', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_0'"):
            greedy(str(mxfp4), quantization)
    # SmolLM3's config is built from the keys alone, so a key it does not read is refused.
    yarn = tmp_path / "smollm3-yarn.gguf"
    write_model_gguf("smollm3", tiny_model("smollm3").hf_model, yarn, rope_scaling=RopeScalingType.YARN)
    with pytest.raises(ValueError, match=r"smollm3.rope.scaling.type='yarn' is not read for a "
                                         r"smollm3 GGUF; supported: none"):
        greedy(str(yarn))
    other = tmp_path / "gemma.gguf"
    writer = GGUFWriter(other, "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma' is not supported; "
                                         r"supported: \['llama', 'qwen2', 'qwen3', 'qwen3moe', "
                                         r"'qwen2moe', 'phi3', 'smollm3'\]"):
        greedy(str(other))
