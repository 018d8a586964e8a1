"""GGUF tensors kept in their file's blocks (quantization="gguf"): the C++ kernels and the
plain-torch de-quantization against the gguf package's own de-quantization, per type, for
every path a layer takes (one row, a small batch, a GEMM over many rows)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvscope.engine.worker.models.quantized import (
    KERNEL_MAX_ROWS,
    LANES_KERNEL_MAX_ROWS,
    TILED_KERNEL_MAX_ROWS,
    GgufBlocks,
    GgufLinear,
    kernel_max_rows,
)
from kvscope.kernels import TORCH_OPS, cpu_extension, gguf_blocks, select_ops
from kvscope.kernels.gguf_blocks import random_blocks
from kvscope.kernels.gguf_lanes import LANES, dequantize_lanes, lanes, lanes_bits

Q = GGMLQuantizationType
SIZE = gguf_blocks.RANDOM_SIZE
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def int8_rounded(x: torch.Tensor, values: int) -> torch.Tensor:
    """x rounded as the int8-dot kernels (AVX512-VNNI, AVX2) round it: per `values` values
    (llama.cpp's q8_K for the k-quants, 256; Q8_0 for the rest, 32), int8 with
    d = max|x| / 127 and q = round(x * (1 / d)), ties to even."""
    blocks = x.float().view(x.shape[0], -1, values)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).view(x.shape)


def reference(blocks: np.ndarray, kind) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, kind))


@pytest.fixture(scope="module")
def cpu_ops():
    return select_ops(torch.device("cpu"))


@pytest.mark.parametrize("kind", gguf_blocks.PACKED_TYPES, ids=lambda kind: kind.name)
def test_both_de_quantizations_equal_the_gguf_package_bit_for_bit(kind, cpu_ops):
    rng = np.random.default_rng(int(kind))
    blocks = random_blocks(kind, 19, 512, rng)
    expected = reference(blocks, kind)
    weight = torch.from_numpy(blocks)
    assert torch.equal(gguf_blocks.dequantize(weight, kind, 512), expected)
    assert torch.equal(cpu_ops.packed.gguf_dequantize(weight, int(kind), 512, torch.float32),
                       expected)
    assert torch.equal(cpu_ops.packed.gguf_dequantize(weight, int(kind), 512, torch.bfloat16),
                       expected.bfloat16())


def gguf_linear(parts: list[tuple[object, torch.Tensor]], in_features: int,
                bias: torch.Tensor | None, ops) -> GgufLinear:
    """A GgufLinear over `parts` (kind or None for dense, rows), packed and bound to `ops`."""
    sizes = [rows.shape[0] for _, rows in parts]
    layer = GgufLinear(in_features, sizes, bias is not None)
    for index, (kind, rows) in enumerate(parts):
        layer.load_part("weight", index, rows if kind is None else GgufBlocks(kind, rows, in_features))
    if bias is not None:
        layer.load_part("bias", None, bias)
    layer.pack(torch.float32, torch.device("cpu"))
    layer.ops = ops
    return layer


def assert_rows_give_the_matmul(layer: GgufLinear, weight: torch.Tensor, bias: torch.Tensor,
                                streamed: int, x_values: int | None) -> None:
    """fp32 activations give the dense matmul to rounding, bf16 ones its result to bf16's:
    up to `streamed` bf16 rows stream the weights (rounded to int8 per `x_values` values
    where the kernels round them, None where they compute exactly), more run a GEMM on
    the weight de-quantized to bf16."""
    in_features = weight.shape[1]
    for rows in (1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, TILED_KERNEL_MAX_ROWS,
                 TILED_KERNEL_MAX_ROWS + 1, LANES_KERNEL_MAX_ROWS, LANES_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, in_features)
        expected = x.double() @ weight.double().T + bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
        layer.bias.data = bias.bfloat16()
        out = layer(x.bfloat16(), torch.float32)
        layer.bias.data = bias
        assert out.dtype == torch.float32
        # A GEMM's weight is de-quantized to bf16 first; the kernels dot fp32 weights.
        streams = rows <= streamed
        gemm_weight = weight if streams else weight.bfloat16()
        x_seen = x.bfloat16()
        if streams and x_values is not None:
            x_seen = int8_rounded(x_seen, x_values)
        rounded = x_seen.double() @ gemm_weight.double().T + bias.bfloat16().double()
        torch.testing.assert_close(out.double(), rounded, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("kind", gguf_blocks.PACKED_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_layer_of_each_type_equals_the_de_quantized_matmul_for_every_row_count(
        kind, backend, cpu_ops):
    """One row and small batches stream the blocks (cpu: up to kernel_max_rows, more bf16
    rows where the kernels round them to int8), more rows de-quantize and run a GEMM; the
    torch backend (and Triton's, which shares it) de-quantizes in plain torch."""
    rng = np.random.default_rng(int(kind) + 100)
    torch.manual_seed(int(kind))
    in_features = 768
    blocks = random_blocks(kind, 40, in_features, rng)
    layer = gguf_linear([(kind, torch.from_numpy(blocks))], in_features, torch.randn(40),
                        cpu_ops if backend == "cpu" else TORCH_OPS)
    rounds = backend == "cpu" and cpu_ops.packed.gguf_rounds_activations_to_int8
    assert_rows_give_the_matmul(
        layer, reference(blocks, kind), layer.bias.data.clone(),
        kernel_max_rows(cpu_ops.packed, torch.bfloat16) if backend == "cpu" else 0,
        (256 if kind in K_QUANTS else 32) if rounds else None)


# A row of lanes' bytes per block of the type's weights: the quants, then the scales.
LANES_BYTES = {Q.Q4_0: 16 + 2, Q.Q4_1: 16 + 4, Q.Q5_0: 20 + 2, Q.Q5_1: 20 + 4, Q.Q8_0: 32 + 2,
               Q.Q4_K: 128 + 20, Q.Q5_K: 160 + 20, Q.Q6_K: 192 + 18}
# Row widths with whole wide blocks (16 chunks of 32), full tail quads (4 chunks) and
# partial ones: 96 (a partial quad alone), 576 (a wide block, a 2-chunk quad), 1280 (two
# wide blocks, two quads); the k-quants' 256 (a super-block's tail alone) and 1536.
LANES_WIDTHS = {kind: [256, 1280, 1536] if kind in K_QUANTS else [96, 576, 1280] for kind in LANES}


def lanes_row_bytes(kind, in_features: int) -> int:
    """5th bits come 16 bytes per 64-byte load of nibbles, a tail's shorter load too."""
    padding = 16 * -(-in_features // 128) - in_features // 8 if lanes_bits(kind) == 5 else 0
    return in_features // GGML_QUANT_SIZES[kind][0] * LANES_BYTES[kind] + padding


@pytest.mark.parametrize(("kind", "in_features"),
                         [(kind, width) for kind in LANES for width in LANES_WIDTHS[kind]],
                         ids=lambda value: getattr(value, "name", str(value)))
def test_rows_repacked_into_lanes_hold_the_same_weights(kind, in_features, cpu_ops):
    """`lanes` keeps every weight bit for bit (both de-quantizations), whole wide blocks or
    not."""
    rng = np.random.default_rng(in_features + int(kind))
    blocks = random_blocks(kind, 24, in_features, rng)
    expected = reference(blocks, kind)
    repacked = lanes(torch.from_numpy(blocks), kind, in_features)
    assert repacked.shape == (24, lanes_row_bytes(kind, in_features))
    assert repacked.dtype == torch.uint8
    assert torch.equal(dequantize_lanes(repacked, kind, in_features), expected)
    assert torch.equal(cpu_ops.packed.gguf_dequantize(repacked, LANES[kind], in_features,
                                                      torch.float32), expected)


@pytest.mark.parametrize("kind", list(LANES), ids=lambda kind: kind.name)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_layer_repacked_into_lanes_equals_the_de_quantized_matmul(kind, backend, cpu_ops):
    """Where the bound kernels stream a type faster as lanes (gguf_repacked_type;
    AVX512-VNNI) the int4 kernels' dots take its bf16 rows, rounded per 32 values as they
    round them; elsewhere the lanes run the exact path. The part keeps its type's name and
    its code changes, so the stack and the memory plan read it as what it is."""
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    in_features = 1280
    blocks = random_blocks(kind, 40, in_features, rng)
    layer = gguf_linear([(kind, torch.from_numpy(blocks))], in_features, torch.randn(40),
                        cpu_ops if backend == "cpu" else TORCH_OPS)
    layer.repack(lambda repacked: LANES[kind] if repacked == kind else -1)
    assert [(part.kind, part.code) for part in layer.parts] == [(kind, LANES[kind])]
    assert layer.weight_bytes_by_type() == {kind.name: 40 * lanes_row_bytes(kind, in_features)}
    lanes_dots = (backend == "cpu"
                  and cpu_ops.packed.gguf_repacked_type(int(kind), torch.bfloat16) == LANES[kind])
    # A model held in lanes (repack_gguf decides it) streams further than int4 and int8 do.
    assert layer.in_lanes()
    limit = kernel_max_rows(cpu_ops.packed, torch.bfloat16)
    assert layer.stream_rows(cpu_ops.packed, torch.bfloat16) == limit
    layer.model_in_lanes = True
    assert layer.stream_rows(cpu_ops.packed, torch.bfloat16) == (
        LANES_KERNEL_MAX_ROWS if limit == TILED_KERNEL_MAX_ROWS else limit)
    assert_rows_give_the_matmul(
        layer, reference(blocks, kind), layer.bias.data.clone(),
        layer.stream_rows(cpu_ops.packed, torch.bfloat16) if backend == "cpu" else 0,
        32 if lanes_dots else None)


def test_only_bf16_activations_on_int8_dot_kernels_repack_into_lanes(cpu_ops):
    """The lanes pay where the int4 kernels' VNNI dots read them; fp32 activations and the
    other types keep the file's blocks."""
    repacked = cpu_ops.packed.gguf_repacked_type
    assert all(repacked(int(kind), torch.float32) == -1 for kind in gguf_blocks.PACKED_TYPES)
    assert all(repacked(int(kind), torch.bfloat16) == -1
               for kind in gguf_blocks.PACKED_TYPES if kind not in LANES)
    flags = cpu_extension.build_flags()
    vnni = all(flag in flags for flag in ("avx512_vnni", "avx512bw", "avx512vl"))
    assert all(repacked(int(kind), torch.bfloat16) == (code if vnni else -1)
               for kind, code in LANES.items())


def test_a_merged_layer_keeps_each_part_in_its_own_type(cpu_ops):
    """Q4_K_M's q and k in Q4_K beside v in Q6_K (one weight for the Q4_K run), and a part
    the file stores dense: one output, each part's columns from its own kernel."""
    rng = np.random.default_rng(7)
    parts = [(Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 32, 256, rng))),
             (Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 16, 256, rng))),
             (Q.Q6_K, torch.from_numpy(random_blocks(Q.Q6_K, 16, 256, rng))),
             (None, torch.randn(8, 256) * SIZE)]
    layer = gguf_linear(parts, 256, None, cpu_ops)
    assert [part.kind for part in layer.parts] == [Q.Q4_K, Q.Q6_K, None]
    assert layer.weight_bytes_by_type() == {"Q4_K": 48 * 144, "Q6_K": 16 * 210, "float32": 8 * 256 * 4}
    weight = torch.cat([rows if kind is None else reference(rows.numpy(), kind)
                        for kind, rows in parts])
    for rows in (1, 20):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_kernels_refuse_a_type_they_do_not_read_and_a_mismatched_weight(cpu_ops):
    x = torch.randn(1, 256)
    out = torch.empty(1, 4)
    weight = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="ggml type 20 is not one of Q4_0"):
        cpu_ops.packed.gguf_linear(x, weight, 20, None, out)
    with pytest.raises(RuntimeError, match=r"weight uint8 \[out_features, in / 256 \* 210\]"):
        cpu_ops.packed.gguf_linear(x, weight, int(Q.Q6_K), None, out)
    with pytest.raises(RuntimeError, match=r"in \(100\) a multiple of the block's 32 weights"):
        cpu_ops.packed.gguf_dequantize(weight, int(Q.Q8_0), 100, torch.float32)
