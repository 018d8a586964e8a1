"""MXFP4 weights kept as gpt-oss ships them: the plain-torch de-quantization against
transformers' own, the quantizer, and the C++ linear and de-quantization against it."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kvscope.kernels import cpu_kernels, mxfp4


def random_mxfp4(out_features: int, in_features: int, seed: int = 0, experts: int | None = None):
    """Random codes and scales around 2^0 (every code, both signs, zeros included)."""
    generator = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    groups = in_features // mxfp4.GROUP
    blocks = torch.randint(0, 256, (*lead, out_features, groups, mxfp4.GROUP_BYTES),
                           dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 131, (*lead, out_features, groups), dtype=torch.uint8,
                           generator=generator)
    return blocks, scales


def test_dequantize_reads_the_layout_transformers_loads():
    """transformers' de-quantization of a checkpoint's [experts, out, groups, 16] tensors,
    transposed back to [experts, out, in], is ours, bit for bit, every scale byte included."""
    blocks, scales = random_mxfp4(6, 96, experts=3)
    scales[0, 0] = torch.arange(3, dtype=torch.uint8) * 127  # 2^-127, 2^0, 2^127
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        ours = mxfp4.dequantize(blocks, scales, dtype)
        assert ours.dtype == dtype and torch.equal(ours, theirs)


def test_quantize_rounds_to_the_nearest_code_with_a_power_of_two_scale():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 128, generator=generator) * 0.02
    blocks, scales = mxfp4.quantize(weight)
    mxfp4.check(blocks, scales, 128, "weight")
    again = mxfp4.dequantize(blocks, scales, torch.float32)
    # Within half the step between the largest codes (4 and 6, times the group's scale).
    exponents = scales.int() - 127
    half_step = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32),
                            exponents).repeat_interleave(32, -1)
    assert ((again - weight).abs() <= half_step).all()
    assert (again != 0).float().mean() > 0.8  # the scales use the codes' range
    # Values MXFP4 holds come back unchanged.
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(again), torch.float32), again)


def test_check_names_the_weight_and_the_shapes_it_needs():
    blocks, scales = random_mxfp4(4, 64)
    with pytest.raises(ValueError, match="gate_up_proj: in_features=40 must be a multiple of 32"):
        mxfp4.check(blocks, scales, 40, "gate_up_proj")
    with pytest.raises(ValueError, match=r"down_proj: MXFP4 blocks \(4, 2, 16\).*\[\.\.\., out, 3, 16\]"):
        mxfp4.check(blocks, scales, 96, "down_proj")
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.check(blocks, scales.float(), 64, "down_proj")


@pytest.fixture(scope="module")
def packed():
    try:
        return cpu_kernels.kernel_ops().packed
    except RuntimeError as error:
        pytest.skip(f"C++ CPU kernels cannot be built here: {error}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 32, 16), (3, 96, 40), (8, 2880, 64), (9, 64, 33), (20, 160, 17)])
def test_cpu_mxfp4_linear_matches_the_oracle(packed, dtype, rows, in_features, out_features):
    """One group and odd group counts, gpt-oss's hidden size (90 groups), a partial block of
    output rows, more rows than one pass streams (8), with and without a bias."""
    blocks, scales = random_mxfp4(out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    weight = mxfp4.dequantize(blocks, scales, torch.float32)
    for with_bias in (None, bias):
        expected = F.linear(x.float(), weight, None if with_bias is None else with_bias.float())
        out = packed.mxfp4_linear(x, blocks.view(out_features, -1, 16), scales, with_bias)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        tolerance = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected.to(dtype).float(), atol=tolerance * 8,
                                   rtol=tolerance)
    widened = packed.mxfp4_linear(x, blocks, scales, bias, torch.float32)
    assert widened.dtype == torch.float32
    assert torch.equal(widened, packed.mxfp4_linear(x, blocks, scales, bias).float())


def test_cpu_mxfp4_linear_computes_each_row_as_alone(packed):
    """A verification chunk's rows are their tokens' decodes, bit for bit."""
    blocks, scales = random_mxfp4(48, 320, seed=5)
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    together = packed.mxfp4_linear(x, blocks, scales, None)
    for m in range(5):
        assert torch.equal(together[m], packed.mxfp4_linear(x[m:m + 1], blocks, scales, None)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_mxfp4_dequantize_is_the_oracle_bit_for_bit(packed, dtype):
    blocks, scales = random_mxfp4(37, 2880, seed=2)
    scales[3, :3] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    assert torch.equal(packed.mxfp4_dequantize(blocks, scales, dtype),
                       mxfp4.dequantize(blocks, scales, dtype))


def test_cpu_mxfp4_kernels_refuse_tensors_not_in_the_format(packed):
    blocks, scales = random_mxfp4(4, 64)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match=r"blocks contiguous uint8 \[out_features, in / 32, 16\]"):
        packed.mxfp4_linear(x, blocks.view(4, 4, 8), scales, None)
    with pytest.raises(RuntimeError, match=r"scales contiguous uint8 \[out_features, in / 32\]"):
        packed.mxfp4_dequantize(blocks, scales[:, :1].contiguous(), torch.float32)
    with pytest.raises(RuntimeError, match=r"x \[rows, in\]"):
        packed.mxfp4_linear(torch.randn(1, 96), blocks, scales, None)
