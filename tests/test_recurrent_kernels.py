"""The recurrent layers' kernels (KernelOps.recurrent: the causal conv and the gated delta rule
over state slots) against their plain-torch oracle (kernels/reference.py, itself held to
transformers in tests/test_recurrent_reference.py): fp32 and bf16 inputs, several slots,
fresh and carried states, lengths past and between the reference's chunks, head dims that
leave a tail after the kernels' 16-lane blocks, and q/k/v as strided splits of one fused
projection (as the layer hands them over)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # @triton.jit reads this when the kernel module is first imported (tests/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvscope.kernels import reference

try:
    from kvscope.kernels import triton_recurrent
except ImportError:  # triton is not installed: the C++ kernels only
    triton_recurrent = None
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_RUNS = triton_recurrent is not None and (torch.cuda.is_available()
                                                or triton_recurrent.INTERPRETED)

SLOTS = 5
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (key heads, value heads, Dk, Dv): grouped heads with a Dv tail; one head per group, whole
# 16-lane blocks; an odd Dk and a Dv below one block
DELTA_RULE_SHAPES = [(2, 4, 16, 24), (2, 2, 32, 32), (1, 3, 7, 5)]


@pytest.fixture
def recurrent(cpu_kernel_ops):
    return cpu_kernel_ops.recurrent


@pytest.fixture(params=["cpu", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_RUNS, reason="triton is not installed (or TRITON_INTERPRET=0 without CUDA)"))])
def decode_kernels(request):
    """(ops, device): the C++ kernels, or the Triton ones (on CUDA, else interpreted)."""
    if request.param == "cpu":
        return request.getfixturevalue("cpu_kernel_ops").recurrent, "cpu"
    return triton_recurrent.RECURRENT, TRITON_DEVICE


def on(device: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in tensors.items()}


def fused_delta_rule_inputs(rows: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                            seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v as views into one [rows, q | k | v] projection, g <= 0 and beta in (0, 1)
    fp32; q and k of norm about 1 (bounded without the l2norm too)."""
    key_heads, value_heads, dk, dv = shape
    generator = torch.Generator().manual_seed(seed)
    key_width = key_heads * dk
    fused = torch.randn(rows, 2 * key_width + value_heads * dv, generator=generator)
    fused[:, :2 * key_width] *= dk ** -0.5
    fused = fused.to(dtype)
    return {"q": fused[:, :key_width].view(rows, key_heads, dk),
            "k": fused[:, key_width:2 * key_width].view(rows, key_heads, dk),
            "v": fused[:, 2 * key_width:].view(rows, value_heads, dv),
            "g": -2 * torch.rand(rows, value_heads, generator=generator),
            "beta": torch.rand(rows, value_heads, generator=generator)}


def state_pool(shape: tuple[int, int, int, int], fresh_slot: int) -> torch.Tensor:
    _, value_heads, dk, dv = shape
    pool = torch.randn(SLOTS, value_heads, dk, dv, generator=torch.Generator().manual_seed(7)) * 0.2
    pool[fresh_slot] = 0
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DELTA_RULE_SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 150])  # one token; a few; past two of the oracle's chunks
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_delta_rule_prefill_matches_the_oracle(recurrent, dtype, shape, rows, use_qk_l2norm):
    """Slot 2 starts fresh, slot 4 carries a state: outputs and final states as the oracle's;
    the other slots untouched."""
    inputs = fused_delta_rule_inputs(rows, shape, dtype)
    for slot in (2, 4):
        pool = state_pool(shape, fresh_slot=2)
        expected_pool = pool.clone()
        out = recurrent.gated_delta_rule_prefill(**inputs, state=pool, slot=slot,
                                                 use_qk_l2norm=use_qk_l2norm)
        expected = reference.gated_delta_rule_prefill(**inputs, state=expected_pool, slot=slot,
                                                      use_qk_l2norm=use_qk_l2norm)
        assert out.dtype == dtype and out.shape == expected.shape
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        torch.testing.assert_close(pool, expected_pool, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DELTA_RULE_SHAPES)
def test_delta_rule_decode_matches_the_oracle(decode_kernels, dtype, shape):
    """Four sequences in slots 3, 0, 2 (fresh), 4, steps one after another: every step's
    outputs and the whole pool as the oracle's."""
    ops, device = decode_kernels
    expected_pool = state_pool(shape, fresh_slot=2)
    pool, slots = expected_pool.to(device, copy=True), torch.tensor([3, 0, 2, 4])
    for step in range(2):
        inputs = fused_delta_rule_inputs(4, shape, dtype, seed=step)
        out = ops.gated_delta_rule_decode(**on(device, inputs), state=pool, slots=slots.to(device),
                                          use_qk_l2norm=step == 0)
        expected = reference.gated_delta_rule_decode(**inputs, state=expected_pool, slots=slots,
                                                     use_qk_l2norm=step == 0)
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
        torch.testing.assert_close(pool.cpu(), expected_pool, atol=1e-4, rtol=1e-4)


def test_delta_rule_prefill_then_decode_carries_the_state(recurrent):
    """A prompt prefilled in two parts and then decoded in its slot gives the oracle's outputs
    for the whole sequence in one prefill."""
    shape = DELTA_RULE_SHAPES[0]
    inputs = fused_delta_rule_inputs(75, shape, torch.float32)
    pool, expected_pool = torch.zeros(SLOTS, 4, 16, 24), torch.zeros(SLOTS, 4, 16, 24)
    outs = [recurrent.gated_delta_rule_prefill(**{n: t[a:b] for n, t in inputs.items()},
                                               state=pool, slot=1, use_qk_l2norm=True)
            for a, b in ((0, 33), (33, 72))]
    outs += [recurrent.gated_delta_rule_decode(**{n: t[r:r + 1] for n, t in inputs.items()},
                                               state=pool, slots=torch.tensor([1]),
                                               use_qk_l2norm=True) for r in range(72, 75)]
    expected = reference.gated_delta_rule_prefill(**inputs, state=expected_pool, slot=1,
                                                  use_qk_l2norm=True)
    torch.testing.assert_close(torch.cat(outs), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(pool, expected_pool, atol=1e-4, rtol=1e-4)


CONV_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.bfloat16, torch.float32)]  # (x's dtype, the state's)


def conv_inputs(rows: int, channels: int, width: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """x as a strided view (the middle third of a [rows, 3 * channels] projection, as LFM2's
    B * x is not but a split is), the weight and the bias."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(rows, 3 * channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator).to(dtype)
    return (fused[:, channels:2 * channels], weight,
            torch.randn(channels, generator=generator).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype,state_dtype", CONV_CASES)
@pytest.mark.parametrize("channels,width", [(12, 4), (300, 3), (600, 2)])  # past a thread's chunk
@pytest.mark.parametrize("rows", [1, 2, 9])  # fewer inputs than the window, as many, more
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_prefill_matches_the_oracle(recurrent, dtype, state_dtype, channels, width, rows,
                                         activation):
    x, weight, bias = conv_inputs(rows, channels, width, dtype, bias=activation is None)
    pool = torch.randn(SLOTS, channels, width - 1).to(state_dtype)
    pool[1] = 0
    for slot in (1, 3):  # fresh, carried
        expected_pool = pool.clone()
        out = recurrent.causal_conv1d_prefill(x, pool, slot, weight, bias, activation)
        expected = reference.causal_conv1d_prefill(x, expected_pool, slot, weight, bias, activation)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        assert torch.equal(pool, expected_pool)


@pytest.mark.parametrize("dtype,state_dtype", CONV_CASES)
@pytest.mark.parametrize("width", [4, 2])
def test_conv_decode_matches_the_oracle(decode_kernels, dtype, state_dtype, width):
    """Three sequences in slots 4, 0, 2, two steps (silu, then none): outputs and windows."""
    ops, device = decode_kernels
    expected_pool = torch.randn(SLOTS, 300, width - 1).to(state_dtype)
    pool, slots = expected_pool.to(device, copy=True), torch.tensor([4, 0, 2])
    for step, activation in enumerate(("silu", None)):
        x, weight, bias = conv_inputs(3, 300, width, dtype, bias=step == 0, seed=step)
        out = ops.causal_conv1d_decode(x.to(device), pool, slots.to(device), weight.to(device),
                                       None if bias is None else bias.to(device), activation)
        expected = reference.causal_conv1d_decode(x, expected_pool, slots, weight, bias, activation)
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
        assert torch.equal(pool.cpu(), expected_pool)


def test_bad_input_is_refused_naming_the_argument(recurrent):
    inputs = fused_delta_rule_inputs(3, DELTA_RULE_SHAPES[0], torch.float32)
    pool = state_pool(DELTA_RULE_SHAPES[0], fresh_slot=0)
    with pytest.raises(ValueError, match="state: the delta rule keeps its state in torch.float32"):
        recurrent.gated_delta_rule_decode(**inputs, state=pool.bfloat16(), slots=torch.arange(3),
                                          use_qk_l2norm=True)
    x, weight, bias = conv_inputs(2, 12, 4, torch.float32, bias=True)
    with pytest.raises(ValueError, match="slot 5: outside the pool's 5 slots"):
        recurrent.causal_conv1d_prefill(x, torch.zeros(SLOTS, 12, 3), 5, weight, bias, None)
    with pytest.raises(ValueError, match="activation 'relu'"):
        recurrent.causal_conv1d_prefill(x, torch.zeros(SLOTS, 12, 3), 0, weight, bias, "relu")
