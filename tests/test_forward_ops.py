"""The C++ versions of the small ops around a layer's matmuls (kernels/cpu_kernels.py)
against their plain-torch twins (kernels/torch_ops.py)."""

import os

import pytest
import torch

from kvscope.kernels import TORCH_OPS

DTYPES = [torch.float32, torch.bfloat16]
# fp32: the same math up to summation order; bf16: one rounding of an fp32 result.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(cpu_kernel_ops, dtype):
    hidden, weight = randn(7, 96, dtype=dtype), randn(96, dtype=dtype, seed=1)
    assert_close(cpu_kernel_ops.rms_norm(hidden, weight, 1e-5), TORCH_OPS.rms_norm(hidden, weight, 1e-5),
                 dtype)
    residual = randn(7, 96, dtype=dtype, seed=2)
    fused_residual, twin_residual = residual.clone(), residual.clone()
    out = cpu_kernel_ops.rms_norm(hidden, weight, 1e-6, fused_residual)
    expected = TORCH_OPS.rms_norm(hidden, weight, 1e-6, twin_residual)
    assert torch.equal(fused_residual, twin_residual)  # residual + hidden, rounded alike
    assert torch.equal(twin_residual, residual + hidden)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_in_place_on_query_and_key_heads(cpu_kernel_ops, dtype, head_dim):
    tokens, heads, width = 5, 6, 8 * head_dim  # 4 query + 2 key heads, then 2 value heads
    qkv = randn(tokens, width, dtype=dtype)
    angles = randn(tokens, head_dim // 2, dtype=torch.float32, seed=3)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    fused_qkv, twin_qkv = qkv.clone(), qkv.clone()
    cpu_kernel_ops.rotary_embedding(fused_qkv, cos, sin, heads, head_dim)
    TORCH_OPS.rotary_embedding(twin_qkv, cos, sin, heads, head_dim)
    assert_close(fused_qkv, twin_qkv, dtype)
    assert torch.equal(fused_qkv[:, heads * head_dim:], qkv[:, heads * head_dim:])
    assert not torch.equal(fused_qkv[:, :heads * head_dim], qkv[:, :heads * head_dim])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_fused_projection_in_place(cpu_kernel_ops, dtype):
    """Qwen3's q/k norms: [tokens, heads, head_dim] rows read from qkv rows (strided; the
    decoder stack writes them back in place, which its own tests compare with the layers)."""
    tokens, heads, head_dim = 5, 6, 32
    qkv = randn(tokens, (heads + 2) * head_dim, dtype=dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(head_dim, dtype=dtype, seed=1)
    normed = cpu_kernel_ops.rms_norm(query, weight, 1e-6)
    assert normed.shape == (tokens, heads, head_dim)
    assert_close(normed, TORCH_OPS.rms_norm(query.contiguous(), weight, 1e-6), dtype)
    # Each head on its own: the first head's norm ignores the others.
    assert_close(normed[:, 0], TORCH_OPS.rms_norm(query[:, 0].contiguous(), weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_turns_the_first_dims_of_each_head_only(cpu_kernel_ops, dtype):
    """Phi-4-mini rotates 3/4 of each head: cos / sin as wide as that part."""
    tokens, heads, head_dim, rotary_dim = 5, 6, 64, 48
    qkv = randn(tokens, 8 * head_dim, dtype=dtype)
    angles = randn(tokens, rotary_dim // 2, dtype=torch.float32, seed=3)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    fused_qkv, twin_qkv = qkv.clone(), qkv.clone()
    cpu_kernel_ops.rotary_embedding(fused_qkv, cos, sin, heads, head_dim)
    TORCH_OPS.rotary_embedding(twin_qkv, cos, sin, heads, head_dim)
    assert_close(fused_qkv, twin_qkv, dtype)
    by_head = fused_qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    original = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    assert torch.equal(by_head[..., rotary_dim:], original[..., rotary_dim:])
    assert not torch.equal(by_head[..., :rotary_dim], original[..., :rotary_dim])
    # The twin is transformers' rotate_half over the rotated part.
    x = original[..., :rotary_dim].float()
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    reference = (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(dtype)
    assert_close(by_head[..., :rotary_dim], reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(cpu_kernel_ops, dtype):
    x = randn(9, 2 * 80, dtype=dtype)
    out = cpu_kernel_ops.silu_and_mul(x)
    assert out.shape == (9, 80)
    assert_close(out, TORCH_OPS.silu_and_mul(x), dtype)


def test_fused_ops_take_rows_of_a_wider_tensor(cpu_kernel_ops):
    """The model hands views (rows of a fused projection); the ops honour row strides."""
    wide = randn(4, 3 * 64, dtype=torch.float32)
    hidden = wide[:, :64]
    weight = randn(64, dtype=torch.float32, seed=1)
    assert_close(cpu_kernel_ops.rms_norm(hidden, weight, 1e-5),
                 TORCH_OPS.rms_norm(hidden.contiguous(), weight, 1e-5), torch.float32)
    gate_up = wide[:, :128]
    assert_close(cpu_kernel_ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up.contiguous()),
                 torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
# in_features: whole 64-element steps, one 32-element step more, a masked tail; out_features
# odd (a thread's share is read as two streams; an odd last row pairs with itself).
@pytest.mark.parametrize("in_features,out_features", [(200, 300), (96, 301), (576, 7)])
def test_linear_one_row_streams_and_more_rows_match_too(cpu_kernel_ops, dtype, rows, in_features,
                                                         out_features):
    x = randn(rows, in_features, dtype=dtype)
    weight = randn(out_features, in_features, dtype=dtype, seed=1)
    bias = randn(out_features, dtype=dtype, seed=2)
    for b in (bias, None):
        out = cpu_kernel_ops.linear(x, weight, b)
        assert out.shape == (rows, out_features)
        torch.testing.assert_close(out.float(), TORCH_OPS.linear(x, weight, b).float(),
                                   atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_logits_are_the_model_dtype_projection_in_fp32(cpu_kernel_ops, dtype, rows):
    """The one-row kernel writes fp32 itself: exactly the model-dtype result widened, as
    more rows (and the torch twin) compute it."""
    hidden = randn(rows, 576, dtype=dtype)
    weight = randn(301, 576, dtype=dtype, seed=1)
    logits = cpu_kernel_ops.logits(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 301)
    assert torch.equal(logits, cpu_kernel_ops.linear(hidden, weight).float())
    torch.testing.assert_close(logits, TORCH_OPS.logits(hidden, weight),
                               atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux thread names")
def test_the_work_pool_threads_are_named_for_the_engine(cpu_kernel_ops):
    """top -H, py-spy and bench/dashboard_overhead.py tell the pool's helpers by name."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_kernel_ops.linear(randn(1, 576, dtype=torch.float32), randn(3000, 576, dtype=torch.float32))
    finally:
        torch.set_num_threads(threads)
    names = [open(f"/proc/self/task/{task}/comm").read().strip()
             for task in os.listdir("/proc/self/task")]
    assert "kvscope-pool" in names


def test_results_do_not_depend_on_threads_or_concurrent_callers(cpu_kernel_ops):
    """kernels/csrc/work_pool: every output comes from exactly one chunk, so 1 or 2 threads,
    and two Python threads calling at once (the second runs its loops serially), agree bit
    for bit."""
    from concurrent.futures import ThreadPoolExecutor

    x = randn(1, 576, dtype=torch.bfloat16)
    weight = randn(3000, 576, dtype=torch.bfloat16, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_kernel_ops.linear(x, weight)
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernel_ops.linear(x, weight), serial)
        with ThreadPoolExecutor(2) as callers:
            results = list(callers.map(lambda _: cpu_kernel_ops.linear(x, weight), range(16)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(result, serial) for result in results)


def gemma_norm(hidden, weight, eps, residual=None, *, out=None):
    """torch.ops.kvscope.rms_norm with unit_offset (the decoder stack's Gemma norm)."""
    out = torch.empty_like(hidden) if out is None else out
    torch.ops.kvscope.rms_norm(hidden, weight, eps, out, residual, unit_offset=True)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_scales_by_one_plus_the_weight(cpu_kernel_ops, dtype):
    """Gemma's norm, (x / rms(x)) * (1 + weight) rounded once, against the eager model's
    module; with a residual, the rounded sum is normalised; per head of a fused projection."""
    from kvscope.engine.worker.models.gemma import GemmaRMSNorm

    hidden, residual = randn(7, 96, dtype=dtype), randn(7, 96, dtype=dtype, seed=2)
    module = GemmaRMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(randn(96, dtype=dtype, seed=1))
        assert_close(gemma_norm(hidden, module.weight, 1e-6), module(hidden), dtype)
        summed = residual.clone()
        out = gemma_norm(hidden, module.weight, 1e-6, summed)
        assert torch.equal(summed, residual + hidden)
        assert_close(out, module(residual + hidden), dtype)
        # Not Llama's weight * normed: the offset matters.
        assert not torch.allclose(out.float(), cpu_kernel_ops.rms_norm(residual + hidden,
                                                              module.weight, 1e-6).float())
        qkv = randn(5, 8 * 32, dtype=dtype, seed=3)
        query = qkv[:, :6 * 32].view(5, 6, 32)
        head_module = GemmaRMSNorm(32, 1e-6).to(dtype)
        head_module.weight.copy_(randn(32, dtype=dtype, seed=4))
        expected = head_module(query)
        gemma_norm(query, head_module.weight, 1e-6, out=query)  # in place, as the stack does
        assert_close(query, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_is_gemma_geglu(cpu_kernel_ops, dtype):
    """gelu (tanh approximation) of the gate times up, over gates from -12 to 12 (tanh's
    both tails and its middle), against F.gelu(approximate="tanh") * up."""
    gate = torch.linspace(-12, 12, 9 * 80).view(9, 80).to(dtype)
    up = randn(9, 80, dtype=dtype)
    x = torch.cat((gate, up), dim=1)
    out = x.new_empty(9, 80)
    torch.ops.kvscope.gelu_tanh_and_mul(x, out)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert_close(out, expected, dtype)
    # rows of a wider tensor (strided), as the stack hands them
    wide = torch.cat((x, x), dim=1)[:, :160]
    strided = x.new_empty(9, 80)
    torch.ops.kvscope.gelu_tanh_and_mul(wide, strided)
    assert torch.equal(strided, out)
