"""GGUF files: their config (what transformers' conversion leaves out, filled in from
llama.cpp's keys) and their weights read straight from the file's blocks, under
transformers' names.

With quantization="gguf" every block tensor (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K: kernels/
gguf_blocks.PACKED_TYPES) arrives as `GgufBlocks`, its bytes as the file stores them, which
the GGUF layers keep and the kernels read. With int4 / int8, Q4_0, Q4_1 and Q8_0 tensors
arrive as `GroupQuantized` blocks (no fp32 copy); the quantized layers copy the 4-bit ones
as they are (Q4_1 is exactly `d * q + m` per 32 weights, the int4 layout's scale and zero)
and re-quantize the rest. F32/F16/BF16 tensors are dense. Any other type (IQ*, TQ*,
MXFP4...) is refused by name at load: nothing is de-quantized to fp32 behind the user's
back. Tensor names are llama.cpp's per architecture: Llama's Q and K
rows are stored permuted for llama.cpp's rotary layout and are un-permuted here, as
transformers does when it converts the file; Qwen's and Phi-3's are stored as they are.
"""

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from transformers import AutoConfig, PretrainedConfig, SmolLM3Config
from transformers.integrations import GGUF_CONFIG_MAPPING

from kvscope.engine.worker.models.quantized import GgufBlocks, GroupQuantized
from kvscope.kernels.gguf_blocks import PACKED_TYPES, row_bytes

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A MoE layer's router and its experts' parts, one 3-D tensor [experts, out, in] each.
EXPERT_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
# Qwen2-MoE's shared expert, an MLP every token runs, behind a sigmoid gate of its own.
SHARED_EXPERT_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                       "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                       "ffn_up_shexp": "mlp.shared_expert.up_proj",
                       "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# Each architecture's block names beyond (or instead of) Llama's, as llama.cpp writes them.
ARCHITECTURE_BLOCK_NAMES = {
    "llama": {},
    "qwen2": {},
    "qwen3": QK_NORM_NAMES,
    "qwen3moe": {**QK_NORM_NAMES, **EXPERT_NAMES},
    "qwen2moe": {**EXPERT_NAMES, **SHARED_EXPERT_NAMES},
    # Phi-3 keeps its fused projections: ffn_up holds gate and up, attn_qkv q, k and v.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "smollm3": {},
}
GGUF_ARCHITECTURES = tuple(ARCHITECTURE_BLOCK_NAMES)
# The transformers class each one is (a config read from a GGUF file names none).
ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                        "qwen2moe": "Qwen2MoeForCausalLM",
                        "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
# What transformers' GGUF reader leaves out of a MoE config, from llama.cpp's keys: the
# experts' width (expert_feed_forward_length) and the shared expert's
# (expert_shared_feed_forward_length); and whether the top-k weights are renormalized,
# which llama.cpp's graph fixes per architecture (Qwen3-MoE's always are, Qwen2-MoE's never).
MOE_WIDTH_KEY = "expert_feed_forward_length"
SHARED_EXPERT_WIDTH_KEY = "expert_shared_feed_forward_length"
NORMALIZED_TOP_K = {"qwen3moe": True, "qwen2moe": False}
# llama.cpp's converter writes SmolLM3 as a Llama (its Q / K rows permuted too).
PERMUTED_QK_ARCHITECTURES = ("llama", "smollm3")
# Architectures transformers' GGUF reader does not know: their config, tokenizer and fp32
# folder are built here from llama.cpp's keys (keys_config) and the file's tensors.
KEYS_ONLY_ARCHITECTURES = ("smollm3",)
# SmolLM3's NoPE layers: llama.cpp fixes them in code, no key stores them (every 4th layer,
# `(il + 1) % 4 == 0`, which is transformers' no_rope_layer_interval=4 default).
SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4
# Rotary factors, which the config carries (gguf_config); no weight of the model: Phi-3's
# LongRoPE factors, and Llama 3.1+'s llama3 scaling as a divisor per rotated pair.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
BLOCK_WEIGHTS = 32  # weights per block in Q4_0, Q4_1 and Q8_0
DENSE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# The types int4 / int8 copy or re-quantize block by block, without a dense copy.
BLOCK_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
SUPPORTED_TYPES = sorted(t.name for t in DENSE_TYPES | set(PACKED_TYPES))


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, parsed once per version of the file: parsing a vocabulary's
    strings (SmolLM2's 49,152 tokens and 48,900 merges) takes most of a second on 2 cores,
    and a load reads the file's fields and tensors from several places."""
    stat = Path(path).stat()
    return _open_gguf(Path(path).resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    return _PlainArrayReader(path)


class _PlainArrayReader(GGUFReader):
    """gguf's reader slicing a plain array view of its memory map: it slices the file once
    per value, twice per vocabulary string, and a numpy.memmap's slices cost several times a
    plain array's (each passes through memmap's __array_finalize__). SmolLM2's file parsed in
    about a third of the time (docs/performance-history.md, 'Load time, next stop'); the
    values and tensors are the same, and each slice still keeps the mapping alive through
    its base."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)


def forget_gguf_readers() -> None:
    """Drop the parsed readers once a model is loaded: each maps its whole file, and the
    pages the load touched would stay in this process's resident set."""
    _open_gguf.cache_clear()


def gguf_architecture(path: Path) -> str:
    return open_gguf(path).fields["general.architecture"].contents()


def check_gguf(path: Path) -> None:
    """Refuse, by name, a GGUF whose architecture or tensor types kvscope does not read."""
    reader = open_gguf(path)
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"model={str(path)!r}: GGUF architecture {architecture!r} is not "
                         f"supported; supported: {list(GGUF_ARCHITECTURES)}")
    for tensor in reader.tensors:
        if tensor.tensor_type not in DENSE_TYPES | set(PACKED_TYPES):
            raise ValueError(
                f"model={str(path)!r}: tensor {tensor.name!r} is {tensor.tensor_type.name}, "
                f"which kvscope does not read; supported GGUF types: {SUPPORTED_TYPES}")


def gguf_config(path: Path) -> PretrainedConfig:
    """transformers' config of the file (keys_config's where transformers cannot read the
    architecture), with what its conversion drops for these architectures taken from
    llama.cpp's keys: the head size (Qwen3's is not hidden / heads), Phi-3's rotary (the
    rotated dims; LongRoPE's factors, stored as tensors) and Llama 3.1+'s llama3 rope
    scaling (stored as `rope_freqs`, a divisor of each rotated pair's frequency: LongRoPE's
    short and long factors are exactly that)."""
    reader = open_gguf(path)
    architecture = reader.fields["general.architecture"].contents()

    def field(key: str):
        found = reader.fields.get(f"{architecture}.{key}")
        return None if found is None else found.contents()

    if architecture in KEYS_ONLY_ARCHITECTURES:
        config = keys_config(path, reader, architecture, field)
    else:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name,
                                            local_files_only=True)

    factors = {tensor.name: np.array(tensor.data, dtype=np.float32).tolist()
               for tensor in reader.tensors if tensor.name in CONFIG_TENSORS}
    if not config.architectures and architecture in ARCHITECTURE_CLASSES:
        config.architectures = [ARCHITECTURE_CLASSES[architecture]]
    if field("attention.key_length") is not None:
        config.head_dim = field("attention.key_length")
    if architecture in NORMALIZED_TOP_K:
        config.moe_intermediate_size = field(MOE_WIDTH_KEY)
        config.norm_topk_prob = NORMALIZED_TOP_K[architecture]
    if field(SHARED_EXPERT_WIDTH_KEY) is not None:
        config.shared_expert_intermediate_size = field(SHARED_EXPERT_WIDTH_KEY)
    if "rope_freqs.weight" in factors:
        divisors = factors["rope_freqs.weight"]
        config.rope_parameters = {
            "rope_type": "longrope", "rope_theta": config.rope_parameters["rope_theta"],
            "short_factor": divisors, "long_factor": divisors, "attention_factor": 1.0,
            "original_max_position_embeddings": config.max_position_embeddings}
    if architecture == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        rotary = dict(config.rope_parameters)
        rotary["partial_rotary_factor"] = (field("rope.dimension_count") or head_dim) / head_dim
        if "rope_factors_long.weight" in factors:
            original = field("rope.scaling.original_context_length")
            rotary.update(rope_type="longrope", original_max_position_embeddings=original,
                          long_factor=factors["rope_factors_long.weight"],
                          short_factor=factors["rope_factors_short.weight"])
            if field("rope.scaling.attn_factor") is not None:  # cos and sin's scale
                rotary["attention_factor"] = field("rope.scaling.attn_factor")
            config.original_max_position_embeddings = original
        config.rope_parameters = rotary
    return config


def keys_config(path: Path, reader: GGUFReader, architecture: str, field) -> PretrainedConfig:
    """A SmolLM3 config from llama.cpp's keys, under the names transformers gives Llama's
    (GGUF_CONFIG_MAPPING); its NoPE layers are llama.cpp's fixed every-4th."""
    scaling = field("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"model={str(path)!r}: {architecture}.rope.scaling.type={scaling!r} is "
                         f"not read for a {architecture} GGUF; supported: none")
    values = {name: field(key) for key, name in GGUF_CONFIG_MAPPING["llama"].items()
              if field(key) is not None}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    values.setdefault("vocab_size", len(tokens.data))
    special = {name: reader.fields[f"tokenizer.ggml.{name}"].contents()
               for name in ("bos_token_id", "eos_token_id", "pad_token_id")
               if f"tokenizer.ggml.{name}" in reader.fields}
    tied = all(tensor.name != "output.weight" for tensor in reader.tensors)
    return SmolLM3Config(
        **{name: value for name, value in values.items() if name != "rope_theta"},
        rope_parameters={"rope_type": "default", "rope_theta": values["rope_theta"]},
        no_rope_layer_interval=SMOLLM3_NO_ROPE_LAYER_INTERVAL, tie_word_embeddings=tied,
        **{"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **special})


def gguf_tensor_bytes_by_type(path: Path) -> dict[str, int]:
    """The bytes of the file's tensors per GGUF type name, as stored."""
    totals: dict[str, int] = {}
    for tensor in open_gguf(path).tensors:
        totals[tensor.tensor_type.name] = totals.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return totals


def gguf_bytes_per_step(path: Path) -> int:
    """The bytes one decode step reads from a GGUF's tensors as stored (Q4_1 blocks, the Q8_0
    table...): all of them, less the token embedding table when a separate output.weight
    makes the logits read that one (a lookup reads one row of the table); of a MoE layer's
    experts (ffn_*_exps), the share one token routes to (expert_used_count of
    expert_count)."""
    reader = open_gguf(path)
    architecture = reader.fields["general.architecture"].contents()
    counts = [reader.fields.get(f"{architecture}.{key}") for key in ("expert_used_count",
                                                                      "expert_count")]
    share = counts[0].contents() / counts[1].contents() if all(counts) else 1.0
    sizes = {tensor.name: int(tensor.n_bytes) * (share if "_exps." in tensor.name else 1)
             for tensor in reader.tensors}
    if "output.weight" in sizes:
        return round(sum(sizes.values()) - sizes["token_embd.weight"])
    return round(sum(sizes.values()))


def iter_gguf_weights(path: Path, config: PretrainedConfig,
                      keep_blocks: bool = False) -> Iterator[tuple[str, object]]:
    """(transformers name, tensor, GroupQuantized or GgufBlocks) for every weight of a GGUF
    file; `keep_blocks`: every block tensor as GgufBlocks (quantization="gguf")."""
    reader = open_gguf(path)
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {architecture!r} is not read block by "
                         f"block (only {list(GGUF_ARCHITECTURES)})")
    permuted = architecture in PERMUTED_QK_ARCHITECTURES
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, architecture)
        value = read_tensor(path, tensor, keep_blocks)
        if permuted and name.endswith("q_proj.weight"):
            value = unpermute_rows(value, config.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            value = unpermute_rows(value, config.num_key_value_heads)
        yield name, value


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = {**BLOCK_NAMES, **ARCHITECTURE_BLOCK_NAMES[architecture]}
        module = f"model.layers.{layer}.{names.get(part, '')}"
        known = part in names
    else:
        module = TOP_LEVEL_NAMES.get(base, "")
        known = base in TOP_LEVEL_NAMES
    if not known:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")
    return f"{module}.{suffix}"


def read_tensor(path: Path, tensor,
                keep_blocks: bool = False) -> "torch.Tensor | GroupQuantized | GgufBlocks":
    kind = tensor.tensor_type
    if kind in DENSE_TYPES:
        return torch.from_numpy(np.array(tensor.data)).float()
    if kind not in PACKED_TYPES:
        raise ValueError(f"{path.name}: tensor {tensor.name!r} is {kind.name}, which kvscope does "
                         f"not read; supported GGUF types: {SUPPORTED_TYPES}")
    rows, in_features = int(np.prod(tensor.shape[1:])), int(tensor.shape[0])
    data = torch.from_numpy(np.array(tensor.data)).view(rows, row_bytes(kind, in_features))
    if keep_blocks or kind not in BLOCK_TYPES:
        return GgufBlocks(kind, data, in_features)
    return decode_blocks(kind, data.view(rows, -1, GGML_QUANT_SIZES[kind][1]))


def decode_blocks(kind: GGMLQuantizationType, blocks: torch.Tensor) -> GroupQuantized:
    """[rows, blocks, bytes per block] of raw bytes -> q, scale and offset per block."""
    rows = blocks.shape[0]
    scale = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if kind == GGMLQuantizationType.Q8_0:  # d (f16), 32 x int8: w = d * q
        q = blocks[..., 2:].contiguous().view(torch.int8)
        return GroupQuantized(q.reshape(rows, -1), scale, None, BLOCK_WEIGHTS, 8)
    if kind == GGMLQuantizationType.Q4_1:  # d, m (f16), 16 bytes of nibbles: w = d * q + m
        offset = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nibbles = blocks[..., 4:]
    else:  # Q4_0: d (f16), 16 bytes of nibbles: w = d * (q - 8)
        offset = -8 * scale
        nibbles = blocks[..., 2:]
    # Byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    return GroupQuantized(q.reshape(rows, -1), scale, offset, BLOCK_WEIGHTS, 4)


def unpermute_rows(value: "torch.Tensor | GroupQuantized | GgufBlocks", num_heads: int):
    """Undo llama.cpp's per-head interleaving of the rotary halves of Q / K rows."""
    rows = (value.q.shape[0] if isinstance(value, GroupQuantized)
            else value.data.shape[0] if isinstance(value, GgufBlocks) else value.shape[0])
    order = torch.arange(rows).view(num_heads, -1, 2).transpose(1, 2).reshape(rows)
    if isinstance(value, GgufBlocks):
        return GgufBlocks(value.kind, value.data[order], value.in_features)
    if isinstance(value, GroupQuantized):
        offset = None if value.offset is None else value.offset[order]
        return GroupQuantized(value.q[order], value.scale[order], offset, value.group_size,
                              value.bits)
    return value[order]
