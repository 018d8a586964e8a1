"""Weight-only int4 / int8: packed layers, GGUF blocks, the engine on quantized weights."""

import copy
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import MOE_ARCHITECTURES
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from torch import nn

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.gguf_weights import gguf_bytes_per_step, iter_gguf_weights, read_tensor
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models.bound_ops import UsesKernelOps, bind_kernel_ops
from kvscope.engine.worker.models.quantized import (
    KERNEL_MAX_ROWS,
    TILED_KERNEL_MAX_ROWS,
    GroupQuantized,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    kernel_max_rows,
    output_logits,
    pack_model,
    quantize_int4,
    quantize_int8,
)
from kvscope.kernels import TORCH_OPS, KernelOps, PackedLinearKernels, cpu_kernels
from kvscope.kernels.gguf_lanes import int4_wide_blocks

CPU = torch.device("cpu")
# Packed matmuls reorder the sums; bf16 activations round every product.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
DOT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # of sum |x| |w| (see its test)


def random_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def packed_kernels() -> PackedLinearKernels:
    """The C++ kernels for packed weights (built, or loaded from the cache, on first use)."""
    return cpu_kernels.kernel_ops().packed


def gemm_rows(dtype: torch.dtype) -> int:
    """A batch past the streaming kernels, which runs a GEMM; skips where none does (bf16
    on a CPU whose bf16 GEMMs run widened: the kernels stream every row count there)."""
    limit = kernel_max_rows(packed_kernels(), dtype)
    if limit == sys.maxsize:
        pytest.skip(f"kernel_max_rows: this CPU streams every row count of {dtype}")
    return limit + 3


def pack(layer: nn.Module, dtype: torch.dtype, ops: KernelOps | None = None) -> None:
    """Pack a layer and bind its kernels (the C++ ones unless `ops`), as the runner does."""
    pack_model(layer, dtype, CPU)
    bind_kernel_ops(layer, ops or cpu_kernels.kernel_ops())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().item()
    assert (actual.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "fallback"])
@pytest.mark.parametrize("path", ["stream", "gemm"])
def test_int4_linear_equals_its_dequantized_weight(path, kernels, dtype):
    batch = 5 if path == "stream" else gemm_rows(dtype)
    rows = [32, 16, 8]  # merged q/k/v rows
    parts = [random_weight(n, 64, seed) for seed, n in enumerate(rows)]
    layer = Int4Linear(64, rows, bias=True, group_size=32)
    for index, part in enumerate(parts):
        layer.load_part("weight", index, part)
    layer.bias.data = torch.arange(sum(rows), dtype=dtype)
    # Without packed kernels: what CUDA or a machine without a C++ compiler runs.
    pack(layer, dtype, None if kernels else TORCH_OPS)

    dequantized = torch.cat([quantize_int4(part, 32).dequantize() for part in parts])
    x = torch.randn(batch, 64).to(dtype)
    assert_close(layer(x), x.float() @ dequantized.T + layer.bias.float(), dtype)
    # Asymmetric min/max rounding is off by at most half a step of its group.
    step = torch.cat([quantize_int4(part, 32).scale for part in parts]).repeat_interleave(32, 1)
    assert ((dequantized - torch.cat(parts)).abs() <= step / 2 + 1e-6).all()


def test_int4_scale_and_offset_are_float16_and_cover_the_group():
    # A group far from zero: rounding its offset to float16 the nearest way would leave
    # the smallest weight below the grid.
    weight = 1000 + torch.linspace(-0.3, 0.7, 64).view(2, 32)
    blocks = quantize_int4(weight, 32)
    for value in (blocks.scale, blocks.offset):
        assert torch.equal(value.half().float(), value)
    assert ((blocks.dequantize() - weight).abs() <= blocks.scale[:, :1] / 2 + 1e-3).all()


def packed_int4_layer(out_features: int, in_features: int, group_size: int,
                      bias: bool) -> Int4Linear:
    layer = Int4Linear(in_features, [out_features], bias=bias, group_size=group_size)
    layer.load_part("weight", 0, random_weight(out_features, in_features, seed=out_features))
    if bias:
        layer.bias.data.normal_()
    pack(layer, torch.float32)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"),
                         [(37, 256, 256), (1, 128, 64), (70, 384, 128), (13, 96, 32),
                          # wide blocks of 16 chunks: alone, + a whole quad, + a tail quad
                          (19, 1536, 256), (33, 640, 32), (5, 576, 64), (3, 1152, 128)])
def test_int4_kernels_equal_the_plain_torch_twin(out_features, in_features, group_size, dtype):
    packed_ops = packed_kernels()
    layer = packed_int4_layer(out_features, in_features, group_size, bias=out_features > 1)
    bias = None if layer.bias is None else layer.bias.to(dtype)
    dense = layer.dequantized_weight(torch.float32)
    # The kernels' de-quantization is the twin's, value for value.
    assert torch.equal(packed_ops.int4_dequantize(layer.weight, layer.scales, layer.offsets,
                                                  group_size, dtype), layer.dequantized_weight(dtype))
    for rows in range(1, KERNEL_MAX_ROWS + 2):  # every specialised row count, and 8 + 1
        x = torch.randn(rows, in_features).to(dtype)
        out = packed_ops.int4_linear(x, layer.weight, layer.scales, layer.offsets, group_size, bias)
        expected = x.float() @ dense.T + (0 if bias is None else bias.float())
        assert out.dtype == dtype
        # Rounding x (bf16 rows to int8 for the VNNI dots) errs in proportion to sum |x| |w|,
        # not to the output, which can cancel to near zero: against the largest output, a
        # single output row erred by up to 13 % (bf16) in 3,200 random cases, while the error
        # stayed under 0.3 % (bf16) and 5e-7 (fp32) of this magnitude.
        bias_magnitude = 0 if bias is None else bias.float().abs()
        magnitude = (x.float().abs() @ dense.abs().T + bias_magnitude).max().item()
        error = (out.float() - expected).abs().max().item()
        assert error <= DOT_TOLERANCE[dtype] * magnitude


def test_int4_wide_blocks_put_each_chunk_in_its_own_lane_and_come_back():
    # 2 rows of 18 chunks: one wide block of 16, then 2 chunks in GGUF's order.
    packed = torch.randint(0, 256, (2, 18 * 16), dtype=torch.uint8)
    wide = int4_wide_blocks(packed)
    for t in range(4):
        for chunk in range(16):
            # Load t's int32 lane `chunk` holds bytes 4t..4t+3 of that chunk.
            assert torch.equal(wide[:, 64 * t + 4 * chunk:64 * t + 4 * chunk + 4],
                               packed[:, 16 * chunk + 4 * t:16 * chunk + 4 * t + 4])
    assert torch.equal(wide[:, 256:], packed[:, 256:])
    assert torch.equal(int4_wide_blocks(wide, inverse=True), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 75), (5, 32), (64, 8)])
def test_int8_kernel_equals_the_plain_torch_twin(out_features, in_features, dtype):
    packed_ops = packed_kernels()
    layer = Int8Linear(in_features, [out_features], bias=True)
    layer.load_part("weight", 0, random_weight(out_features, in_features))
    layer.bias.data.normal_()
    pack(layer, torch.float32)
    dense, bias = layer.dequantized_weight(torch.float32), layer.bias.to(dtype)
    assert torch.equal(packed_ops.int8_dequantize(layer.weight, layer.scales, dtype),
                       layer.dequantized_weight(dtype))
    for rows in range(1, KERNEL_MAX_ROWS + 2):
        x = torch.randn(rows, in_features).to(dtype)
        out = packed_ops.int8_linear(x, layer.weight, layer.scales, bias)
        assert_close(out, x.float() @ dense.T + bias.float(), dtype)


def blockwise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the VNNI kernels round it: per block of 32 values d = max|x| / 127 and
    q = round(x * (1 / d)), ties to even. Returns (q * d, d per value)."""
    rows, width = x.shape
    blocks = F.pad(x.float(), (0, -width % 32)).view(rows, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = (blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))).round()
    return ((q * d).view(rows, -1)[:, :width],
            d.expand_as(blocks).reshape(rows, -1)[:, :width])


def uneven_activations(rows: int, width: int) -> torch.Tensor:
    """bf16 rows whose 32-value blocks differ in magnitude by up to 1000x: a block dotted
    with another block's scale shows."""
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    magnitude = 10 ** torch.empty(rows, -(-width // 32)).uniform_(-2, 1, generator=generator)
    x = torch.randn(rows, width, generator=generator)
    return (x * magnitude.repeat_interleave(32, 1)[:, :width]).bfloat16()


def assert_activation_rounding(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out = x @ weight.T with x rounded per block (blockwise_int8) in the VNNI build, and
    exact otherwise; the output is bf16, so up to its rounding (2^-8 relative)."""
    exact = x.float() @ weight.T
    rounded, d = blockwise_int8(x)
    bf16_rounding = 2.0 ** -8 * exact.abs() + 1e-6 * exact.abs().max()
    # Half a step of each value's block, times its weight: the most rounding can move it.
    bound = (d / 2) @ weight.abs().T
    assert ((out.float() - exact).abs() <= bound * 1.001 + bf16_rounding).all()
    if packed_kernels().rounds_activations_to_int8:
        expected = rounded @ weight.T
        assert ((out.float() - expected).abs() <= 2.0 ** -8 * expected.abs()
                + 1e-5 * expected.abs().max()).all()


# Every row count the kernels specialise (1..8), then batches the VNNI kernels take in groups
# of 8 against each tile of output rows: a whole and a partial last group.
TILE_ROW_COUNTS = [*range(1, KERNEL_MAX_ROWS + 2), 16, 21, TILED_KERNEL_MAX_ROWS]


@pytest.mark.parametrize(("out_features", "in_features", "group_size"),
                         [(37, 256, 32), (70, 96, 32), (21, 384, 128), (16, 576, 64),
                          (1, 128, 64), (24, 1536, 32), (9, 640, 128), (7, 1024, 256)])
def test_int4_kernel_with_bf16_rounds_activations_per_block(out_features, in_features,
                                                            group_size):
    # Weights far from zero: the offsets carry most of each weight, and the rounded x's
    # sums must meet them (x's own sums would leave an error of the offsets' size).
    weight = random_weight(out_features, in_features, seed=3) + 4
    layer = Int4Linear(in_features, [out_features], bias=False, group_size=group_size)
    layer.load_part("weight", 0, weight)
    pack(layer, torch.bfloat16)
    dense = layer.dequantized_weight(torch.float32)
    for rows in TILE_ROW_COUNTS:
        x = uneven_activations(rows, in_features)
        out = packed_kernels().int4_linear(x, layer.weight, layer.scales, layer.offsets,
                                           group_size, None)
        assert_activation_rounding(out, x, dense)


def test_the_int4_and_int8_kernels_take_a_prefill_span_by_span():
    """A prefill's bf16 rows meet the weights span by span (kernels/csrc/quantized/vnni.h's
    kHeldXBytes: 1 MiB of rounded x, about 600 rows of 1536 features): two whole spans and
    a part of one, each against every tile of output rows."""
    rows, in_features = 1500, 1536
    x = uneven_activations(rows, in_features)
    int4 = Int4Linear(in_features, [40], bias=False, group_size=32)
    int4.load_part("weight", 0, random_weight(40, in_features, seed=7) + 4)
    int8 = Int8Linear(in_features, [40], bias=False)
    int8.load_part("weight", 0, random_weight(40, in_features, seed=8))
    for layer in (int4, int8):
        pack(layer, torch.bfloat16)
    assert_activation_rounding(packed_kernels().int4_linear(
        x, int4.weight, int4.scales, int4.offsets, 32, None), x,
        int4.dequantized_weight(torch.float32))
    assert_activation_rounding(packed_kernels().int8_linear(x, int8.weight, int8.scales, None),
                               x, int8.dequantized_weight(torch.float32))


@pytest.mark.parametrize(("out_features", "in_features"), [(37, 75), (5, 32), (64, 8),
                                                           (19, 576), (3, 200)])
def test_int8_kernel_with_bf16_rounds_activations_per_block(out_features, in_features):
    layer = Int8Linear(in_features, [out_features], bias=False)
    layer.load_part("weight", 0, random_weight(out_features, in_features, seed=4))
    pack(layer, torch.bfloat16)
    for rows in TILE_ROW_COUNTS:
        x = uneven_activations(rows, in_features)
        out = packed_kernels().int8_linear(x, layer.weight, layer.scales, None)
        assert_activation_rounding(out, x, layer.dequantized_weight(torch.float32))


@pytest.mark.parametrize(("out_features", "in_features"), [(37, 75), (19, 576), (3, 200)])
def test_int8_kernel_writes_bf16_logits_widened_into_fp32_bit_for_bit(out_features,
                                                                      in_features):
    packed_ops = packed_kernels()
    # The logits: an fp32 out holds exactly the bf16 result widened (what .float() gave),
    # in whole 16-row blocks, a partial last block and every tile of rows.
    layer = Int8Linear(in_features, [out_features], bias=True)
    layer.load_part("weight", 0, random_weight(out_features, in_features, seed=5))
    layer.bias.data = torch.randn(out_features).bfloat16()  # the model's dtype, as loaded
    pack(layer, torch.bfloat16)
    bias = layer.bias
    embedding = Int8Embedding(out_features, in_features)
    embedding.load_part("weight", 0, random_weight(out_features, in_features, seed=6))
    pack(embedding, torch.bfloat16)
    streamed = kernel_max_rows(packed_ops, torch.bfloat16)
    for rows in [*TILE_ROW_COUNTS, *([streamed + 3] if streamed < sys.maxsize else [])]:
        x = uneven_activations(rows, in_features)
        if rows <= streamed:
            widened = packed_ops.int8_linear(x, layer.weight, layer.scales, bias, torch.float32)
            assert widened.dtype == torch.float32
            assert torch.equal(widened, packed_ops.int8_linear(x, layer.weight, layer.scales,
                                                               bias).float())
        for projection, bf16_logits in ((layer, layer(x)), (embedding, embedding.project(x))):
            logits = output_logits(projection, x)
            assert logits.dtype == torch.float32
            assert torch.equal(logits, bf16_logits.float())
    with pytest.raises(RuntimeError, match="out .rows, out_features. of x's dtype"):
        packed_ops.int8_linear(x[:1], layer.weight, layer.scales, bias, torch.float16)


def test_int4_kernel_reads_strided_rows_and_refuses_bad_layouts():
    packed_ops = packed_kernels()
    layer = packed_int4_layer(16, 64, 32, bias=False)
    wide = torch.randn(3, 100)
    x = wide[:, 10:74]  # rows of a bigger activation, as a fused projection's views are
    out = packed_ops.int4_linear(x, layer.weight, layer.scales, layer.offsets, 32, None)
    assert_close(out, x @ layer.dequantized_weight(torch.float32).T, torch.float32)
    with pytest.raises(RuntimeError, match="group_size"):
        packed_ops.int4_linear(x.contiguous(), layer.weight, layer.scales, layer.offsets, 48, None)
    with pytest.raises(RuntimeError, match="float16"):
        packed_ops.int4_linear(x.contiguous(), layer.weight, layer.scales.float(), layer.offsets,
                               32, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["stream", "gemm"])
def test_int8_linear_and_embedding_equal_their_dequantized_weight(path, dtype):
    batch = 3 if path == "stream" else gemm_rows(dtype)
    weight = random_weight(48, 32)
    q, scale = quantize_int8(weight)
    dequantized = q.float() * scale.unsqueeze(-1)
    assert ((dequantized - weight).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all()

    linear, embedding = Int8Linear(32, [48], bias=False), Int8Embedding(48, 32)
    for layer in (linear, embedding):
        layer.load_part("weight", 0, weight)
        pack(layer, dtype)
    x = torch.randn(batch, 32).to(dtype)
    assert_close(linear(x), x.float() @ dequantized.T, dtype)
    assert_close(embedding.project(x), x.float() @ dequantized.T, dtype)
    ids = torch.tensor([[0, 47], [5, 5]])
    assert embedding(ids).dtype == dtype
    assert_close(embedding(ids), dequantized[ids], dtype)


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:
    writer = GGUFWriter(path, "llama")
    for name, (values, kind) in tensors.items():
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_blocks_decode_exactly_and_q4_1_packs_without_loss(tmp_path):
    rng = np.random.default_rng(0)
    values = {"blk.0.ffn_up.weight": GGMLQuantizationType.Q4_1,
              "blk.0.ffn_gate.weight": GGMLQuantizationType.Q4_0,
              "token_embd.weight": GGMLQuantizationType.Q8_0,
              "blk.0.ffn_norm.weight": GGMLQuantizationType.F32}
    tensors = {name: (rng.standard_normal((32,) if "norm" in name else (48, 64))
                      .astype(np.float32), kind) for name, kind in values.items()}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tensors)

    for tensor in GGUFReader(path).tensors:
        value = read_tensor(path, tensor)
        expected = torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type)))
        actual = value.dequantize() if isinstance(value, GroupQuantized) else value
        assert torch.equal(actual, expected), tensor.name  # gguf's own de-quantization
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            layer = Int4Linear(64, [48], bias=False, group_size=32)
            layer.load_part("weight", 0, value)
            assert torch.equal(layer.staged_q, value.q)  # copied, not re-quantized
            pack(layer, torch.float32)
            # d and m stay float16 values: q * d + m as gguf computes it, up to fp32 rounding
            # (the identity's rows run the GEMM path; its first rows the streaming kernel).
            identity = torch.eye(64)
            assert torch.allclose(layer(identity).T, expected, rtol=0, atol=1e-6)
            streamed = layer(identity[:KERNEL_MAX_ROWS]).T
            assert torch.allclose(streamed, expected[:, :KERNEL_MAX_ROWS], rtol=0, atol=1e-6)


@pytest.mark.parametrize("gguf_name", ["attn_q", "attn_k"])
def test_gguf_q_and_k_rows_are_unpermuted_as_transformers_does(gguf_name, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rows = 64 if gguf_name == "attn_q" else 32
    values = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
    path = tmp_path / "qk.gguf"
    write_gguf(path, {f"blk.0.{gguf_name}.weight": (values, GGMLQuantizationType.Q4_1)})
    (name, value), = iter_gguf_weights(path, config)
    assert name.endswith("q_proj.weight" if gguf_name == "attn_q" else "k_proj.weight")

    stored = GGUFReader(path).tensors[0]
    dequantized = quants.dequantize(stored.data, stored.tensor_type)
    processor = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    expected = processor.process(dequantized, stored.name).weights
    assert torch.equal(value.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


def test_unsupported_gguf_type_names_the_tensor_and_its_type(tmp_path):
    values = np.zeros((16, 64), dtype=np.float32)
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": (values, GGMLQuantizationType.MXFP4)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' is MXFP4.*Q4_1"):
        list(iter_gguf_weights(path, None))


@pytest.mark.parametrize(("knob", "value"), [("quantization", "int3"), ("quantization", ""),
                                             ("quantization_group_size", 48),
                                             ("quantization_group_size", 32.0)])
def test_bad_quantization_knobs_name_the_knob_and_the_choices(knob, value):
    with pytest.raises(ValueError, match=rf"{knob}=.*must be one of"):
        EngineConfig(**{knob: value})


def test_group_size_that_does_not_fit_a_layer_is_refused(tiny_model):
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          device_memory_gb=0.05, quantization="int4",
                          quantization_group_size=128)  # the layers have 64 inputs
    with pytest.raises(ValueError, match=r"quantization_group_size=128 .* 64; use one of \[32, 64\]"):
        ModelRunner(config)


def fake_quantized(model: nn.Module, quantization: str) -> nn.Module:
    """A transformers model whose weights are replaced by what the engine's packed layers
    de-quantize to: int4 (or int8) linears, int8 embedding and lm_head."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        # A MoE layer's experts (transformers' 3-D gate_up_proj / down_proj) quantize like
        # linears, output row by output row (gpt-oss holds them [experts, in, out]); its
        # router stays as it is.
        transposed = model.config.model_type == "gpt_oss"
        for name, parameter in model.named_parameters():
            if parameter.dim() == 3 and ".experts." in name:
                weight = parameter.transpose(1, 2) if transposed else parameter
                rows = weight.reshape(-1, weight.shape[-1])
                if quantization == "int4":
                    rows = quantize_int4(rows, 32).dequantize()
                else:
                    q, scale = quantize_int8(rows)
                    rows = q.float() * scale.unsqueeze(-1)
                weight.copy_(rows.view(weight.shape))
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and quantization == "int4" and "lm_head" not in name:
                module.weight.copy_(quantize_int4(module.weight, 32).dequantize())
            elif isinstance(module, nn.Linear) or name.endswith("embed_tokens"):
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale.unsqueeze(-1))
    return model


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "llama3", "qwen3", "smollm3", "phi3",
                                  "gemma3", "gemma2", *MOE_ARCHITECTURES])
def test_quantized_engine_is_greedy_equal_to_its_dequantized_weights(arch, quantization,
                                                                    tiny_model, run_engine):
    tiny = tiny_model(arch)
    reference = fake_quantized(tiny.hf_model, quantization)
    prompts = [[5, 17, 200, 31, 9], list(range(40, 90))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    knobs = {"model": str(tiny.path), "dtype": "float32", "device": "cpu",
             "device_memory_gb": 0.05}
    engine = EngineCore(EngineConfig(**knobs, quantization=quantization))
    dense = EngineCore(EngineConfig(**knobs))
    for prompt, output in zip(prompts, run_engine(engine, prompts, params).outputs):
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8,
                                          min_new_tokens=8, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()
    # The packed twins replaced every dense linear, and every module (the packed ones too)
    # is bound to the same kernels as in the dense engine.
    modules = list(engine.runner.model.modules())
    assert not any(isinstance(module, nn.Linear) for module in modules)
    assert engine.runner.kernel_ops is dense.runner.kernel_ops
    assert all(module.ops is engine.runner.kernel_ops for module in modules
               if isinstance(module, UsesKernelOps))
    # The packed weights are what the memory plan subtracts, so the pool grows.
    assert engine.runner.weight_bytes < dense.runner.weight_bytes / 2
    assert engine.memory_plan.num_blocks > dense.memory_plan.num_blocks


@pytest.mark.slow
def test_default_gguf_blocks_equal_the_transformers_conversion():
    """Every tensor read block by block from the shipped Q4_1 file de-quantizes to exactly
    the fp32 value transformers' one-time conversion wrote (Q/K un-permuted included)."""
    from kvscope.engine.worker import loader

    folder = loader.resolve_model_path(None)
    converted = dict(loader.iter_weights(folder))
    read = dict(iter_gguf_weights(loader.find_default_gguf(), loader.load_config(folder)))
    assert read.keys() == converted.keys()
    kinds = {type(value).__name__ for value in read.values()}
    assert kinds == {"GroupQuantized", "Tensor"}
    for name, value in read.items():
        actual = value.dequantize() if isinstance(value, GroupQuantized) else value
        assert torch.equal(actual, converted[name].float()), name


@pytest.mark.slow
def test_default_model_in_int4_knows_the_capital_of_france(all_cpu_threads):
    from kvscope import LLM

    llm = LLM(quantization="int4")
    assert llm.engine.runner.weight_bytes < 100e6  # 257 MiB in bf16
    # A 135M model's first token is a near tie on any one phrasing ("The" against "L" 0.05
    # to 0.12 nats apart, fp32 or bf16 activations), which rounding tips either way: it
    # knows the answer if most phrasings give it.
    questions = ["What is the capital of France?", "Which city is the capital of France?",
                 "What is the capital of France? Answer in one word."]
    outputs = llm.chat([[{"role": "user", "content": question}] for question in questions],
                       SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    answers = [output.outputs[0].text for output in outputs]
    assert sum("Paris" in answer for answer in answers) >= 2, answers


def test_packed_weights_of_a_gguf_model_are_cached_for_the_next_start(tiny_model, tmp_path,
                                                                       monkeypatch):
    """The first start packs and saves; the next reads the packed state without touching the
    checkpoint; a changed file (new mtime) packs afresh."""
    from kvscope.engine.worker import model_runner, packed_cache

    gguf = tmp_path / "model.gguf"  # stands in for the file: its size and mtime key the cache
    gguf.write_bytes(b"not read")
    monkeypatch.setattr(packed_cache, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(model_runner, "gguf_file", lambda model: gguf)
    monkeypatch.setattr(model_runner, "gguf_architecture", lambda path: "opt")  # HF folder
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          device_memory_gb=0.05, quantization="int4")
    first = ModelRunner(config)
    assert len(list((tmp_path / "cache" / "packed").glob("*.pt"))) == 1

    def unread(self, config):
        raise AssertionError("the checkpoint was read despite the cache")
    with monkeypatch.context() as patch:
        patch.setattr(ModelRunner, "checkpoint_weights", unread)
        second = ModelRunner(config)
    expected = first.model.state_dict()
    assert all(torch.equal(value, expected[name])
               for name, value in second.model.state_dict().items())
    layer = second.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(3, layer.in_features)
    assert layer.ops.packed is not None
    assert torch.equal(layer(x), first.model.model.layers[0].mlp.gate_up_proj(x))

    os.utime(gguf, ns=(0, 0))
    ModelRunner(config)
    assert len(list((tmp_path / "cache" / "packed").glob("*.pt"))) == 2


@pytest.mark.parametrize("untied", [False, True])
def test_a_gguf_step_reads_its_blocks_as_stored(untied, tmp_path):
    """bench/throughput.py's bandwidth limit for llama_cpp: the GGUF's tensors as stored
    (34 bytes per 32 Q8_0 weights, 20 per 32 Q4_1), the embedding table counted only when
    the logits read it (tied)."""
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (rng.standard_normal((96, 64), np.float32),
                                     GGMLQuantizationType.Q8_0),
               "blk.0.ffn_down.weight": (rng.standard_normal((48, 64), np.float32),
                                         GGMLQuantizationType.Q4_1),
               "output_norm.weight": (np.ones(64, np.float32), GGMLQuantizationType.F32)}
    if untied:
        tensors["output.weight"] = (rng.standard_normal((96, 64), np.float32),
                                    GGMLQuantizationType.Q8_0)
    write_gguf(tmp_path / "model.gguf", tensors)
    table, layer, norm = 96 * 2 * 34, 48 * 2 * 20, 64 * 4
    assert gguf_bytes_per_step(tmp_path / "model.gguf") == table + layer + norm
