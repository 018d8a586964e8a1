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
    TILED_KERNEL_MAX_ROWS,
    GgufBlocks,
    GgufLinear,
    kernel_max_rows,
)
from kvscope.kernels import TORCH_OPS, gguf_blocks, select_ops

Q = GGMLQuantizationType
# Where each type keeps its float16 scales (d, and m / dmin), and the largest |q|-times-
# sub-scale it multiplies them by, so random blocks give weights within about +-SIZE.
FP16_FIELDS = {Q.Q4_0: {0: 8}, Q.Q4_1: {0: 8, 2: -1}, Q.Q5_0: {0: 16}, Q.Q5_1: {0: 16, 2: -1},
               Q.Q8_0: {0: 128}, Q.Q4_K: {0: 63 * 15 / 2, 2: 63}, Q.Q5_K: {0: 63 * 31 / 2, 2: 63},
               Q.Q6_K: {208: 32 * 127}}
SIZE = 0.2
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def random_blocks(kind: GGMLQuantizationType, rows: int, in_features: int,
                  rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random quants and sub-scales (every bit pattern is a valid
    block) with finite float16 scales of about SIZE over their range."""
    weights, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, in_features // weights, size), dtype=np.uint8)
    for at, span in FP16_FIELDS[kind].items():
        scale = (SIZE / span * rng.uniform(0.5, 1.5, blocks.shape[:2])).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


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


@pytest.mark.parametrize("kind", gguf_blocks.PACKED_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_layer_of_each_type_equals_the_de_quantized_matmul_for_every_row_count(
        kind, backend, cpu_ops):
    """One row and small batches stream the blocks (cpu: up to kernel_max_rows, 32 bf16
    rows where the kernels round them to int8), more rows de-quantize and run a GEMM; the
    torch backend (and Triton's, which shares it) de-quantizes in plain torch.
    fp32 activations give the dense matmul to rounding, bf16 ones its result to bf16's
    (where the int8-dot kernels stream: the product of x rounded as they round it)."""
    rng = np.random.default_rng(int(kind) + 100)
    torch.manual_seed(int(kind))
    in_features = 768
    blocks = random_blocks(kind, 40, in_features, rng)
    weight = reference(blocks, kind)
    bias = torch.randn(40)
    layer = gguf_linear([(kind, torch.from_numpy(blocks))], in_features, bias,
                        cpu_ops if backend == "cpu" else TORCH_OPS)
    bf16_streamed = kernel_max_rows(cpu_ops.packed, torch.bfloat16) if backend == "cpu" else 0
    for rows in (1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, TILED_KERNEL_MAX_ROWS,
                 TILED_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, in_features)
        expected = x.double() @ weight.double().T + bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
        layer.bias.data = bias.bfloat16()
        out = layer(x.bfloat16(), torch.float32)
        layer.bias.data = bias
        assert out.dtype == torch.float32
        # A GEMM's weight is de-quantized to bf16 first; the kernels dot fp32 weights.
        streams = rows <= bf16_streamed
        gemm_weight = weight if streams else weight.bfloat16()
        x_seen = x.bfloat16()
        if streams and cpu_ops.packed.gguf_rounds_activations_to_int8:
            x_seen = int8_rounded(x_seen, 256 if kind in K_QUANTS else 32)
        rounded = x_seen.double() @ gemm_weight.double().T + bias.bfloat16().double()
        torch.testing.assert_close(out.double(), rounded, rtol=2 ** -7, atol=1e-2)


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
