"""The plain-torch oracle of the recurrent layers' ops (kernels/reference.py: the causal conv
and the gated delta rule over state slots) against transformers' own torch implementations
(Qwen3.5's torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule and conv functions,
LFM2's conv update), with fresh and continued states in a pool of several slots."""

import pytest
import torch
from transformers.models.lfm2 import modeling_lfm2
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from kvscope.kernels import TORCH_OPS, reference

SLOTS = 5
FP32 = dict(atol=2e-5, rtol=1e-4)


def delta_rule_inputs(rows: int, key_heads: int, value_heads: int, dim: int = 16,
                      dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta as Qwen3.5's layer makes them: g = -A softplus(a + dt_bias) <= 0,
    beta a sigmoid; q and k of norm about 1, so that the recurrence stays bounded without the
    l2norm too."""
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, key_heads, dim, generator=generator) * dim ** -0.5
            for _ in range(2))
    v = torch.randn(rows, value_heads, dim + 8, generator=generator)
    g = -torch.rand(value_heads, generator=generator) * 4 * torch.nn.functional.softplus(
        torch.randn(rows, value_heads, generator=generator))
    beta = torch.rand(rows, value_heads, generator=generator)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "g": g, "beta": beta}


def state_pool(value_heads: int, key_dim: int, value_dim: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, value_heads, key_dim, value_dim, generator=generator) * 0.2


def transformers_delta_rule(inputs: dict[str, torch.Tensor], initial: torch.Tensor | None,
                            use_qk_l2norm: bool, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through transformers (batch of one): (o [T, Hv, Dv], final state)."""
    function = (qwen3_5.torch_chunk_gated_delta_rule if chunked
                else qwen3_5.torch_recurrent_gated_delta_rule)
    batch = {name: t.unsqueeze(0) for name, t in inputs.items()}
    out, final = function(batch["q"], batch["k"], batch["v"], g=batch["g"], beta=batch["beta"],
                          initial_state=None if initial is None else initial.unsqueeze(0),
                          output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out[0], final[0]


@pytest.mark.parametrize("rows", [1, 37, 130])  # one token; under a chunk; over two, ragged
@pytest.mark.parametrize("key_heads,value_heads", [(2, 2), (2, 6)])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("fresh", [True, False])
def test_delta_rule_prefill_matches_transformers(rows, key_heads, value_heads, use_qk_l2norm,
                                                 fresh):
    """The chunked prefill of one sequence in slot 3 gives transformers' outputs and final
    state (both its chunked and its per-token forms), from zeros or a carried state, and
    leaves the other slots alone."""
    inputs = delta_rule_inputs(rows, key_heads, value_heads)
    pool = state_pool(value_heads, 16, 24)
    if fresh:
        pool[3] = 0
    before = pool.clone()
    out = reference.gated_delta_rule_prefill(**inputs, state=pool, slot=3,
                                             use_qk_l2norm=use_qk_l2norm)
    for chunked in (True, False):
        expected, final = transformers_delta_rule(inputs, None if fresh else before[3],
                                                  use_qk_l2norm, chunked)
        torch.testing.assert_close(out, expected, **FP32)
        torch.testing.assert_close(pool[3], final, **FP32)
    others = [s for s in range(SLOTS) if s != 3]
    assert torch.equal(pool[others], before[others])


def test_delta_rule_decode_matches_transformers_per_slot():
    """A decode step of three sequences in slots 4, 0, 2 (out of order) gives each one
    transformers' per-token step from its own state."""
    inputs = delta_rule_inputs(3, 2, 4)
    pool, slots = state_pool(4, 16, 24), torch.tensor([4, 0, 2])
    before = pool.clone()
    out = reference.gated_delta_rule_decode(**inputs, state=pool, slots=slots, use_qk_l2norm=True)
    for b, slot in enumerate(slots.tolist()):
        row = {name: t[b:b + 1] for name, t in inputs.items()}
        expected, final = transformers_delta_rule(row, before[slot], True, chunked=False)
        torch.testing.assert_close(out[b], expected[0], **FP32)
        torch.testing.assert_close(pool[slot], final, **FP32)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_delta_rule_prefill_in_chunks_then_decode_equals_one_pass():
    """A prompt prefilled in two chunks then decoded token by token (the state carried in
    its slot) gives transformers' outputs for the whole sequence at once."""
    inputs = delta_rule_inputs(90, 2, 4)
    pool = torch.zeros(SLOTS, 4, 16, 24)
    parts = [reference.gated_delta_rule_prefill(**{n: t[a:b] for n, t in inputs.items()},
                                                state=pool, slot=1, use_qk_l2norm=True)
             for a, b in ((0, 70), (70, 85))]
    for row in range(85, 90):
        step = {name: t[row:row + 1] for name, t in inputs.items()}
        parts.append(reference.gated_delta_rule_decode(**step, state=pool, slots=torch.tensor([1]),
                                                       use_qk_l2norm=True))
    expected, final = transformers_delta_rule(inputs, None, True, chunked=True)
    torch.testing.assert_close(torch.cat(parts), expected, **FP32)
    torch.testing.assert_close(pool[1], final, **FP32)


def test_delta_rule_takes_bf16_inputs_into_an_fp32_state():
    """bf16 q/k/v (a bf16 model's projections) are computed in fp32, as transformers does, and
    the output comes back in bf16."""
    inputs = delta_rule_inputs(40, 2, 4, dtype=torch.bfloat16)
    pool = state_pool(4, 16, 24)
    before = pool.clone()
    out = reference.gated_delta_rule_prefill(**inputs, state=pool, slot=0, use_qk_l2norm=True)
    expected, final = transformers_delta_rule(inputs, before[0], True, chunked=True)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[0], final, **FP32)


def conv_inputs(rows: int, channels: int = 12, width: int = 4, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, channels, generator=generator),
            torch.randn(channels, width, generator=generator),
            torch.randn(channels, generator=generator))


@pytest.mark.parametrize("rows", [1, 2, 9])  # fewer, as many as and more inputs than W - 1
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_prefill_matches_transformers(rows, activation, with_bias):
    """A fresh slot (zeros) gives causal_conv1d_fn over the inputs alone; a carried window gives
    causal_conv1d_update over it (transformers keeps W inputs, kvscope the last W - 1: the
    oldest never reaches the output). The slot ends with the last W - 1 inputs of the
    carried window followed by x."""
    x, weight, bias = conv_inputs(rows)
    bias = bias if with_bias else None
    pool = torch.randn(SLOTS, 12, 3)
    pool[2] = 0
    carried = pool[4].clone()
    fresh_out = reference.causal_conv1d_prefill(x, pool, 2, weight, bias, activation)
    expected = qwen3_5.causal_conv1d_fn(x.T.unsqueeze(0), weight, bias, activation=activation)
    torch.testing.assert_close(fresh_out, expected[0].T, **FP32)
    out = reference.causal_conv1d_prefill(x, pool, 4, weight, bias, activation)
    theirs = torch.cat((torch.zeros(12, 1), carried), dim=1).unsqueeze(0)
    expected = qwen3_5.causal_conv1d_update(x.T.unsqueeze(0), theirs, weight, bias, activation)
    torch.testing.assert_close(out, expected[0].T, **FP32)
    torch.testing.assert_close(pool[4], theirs[0, :, 1:])
    torch.testing.assert_close(pool[2], torch.cat((torch.zeros(12, 3), x.T), dim=1)[:, -3:])


@pytest.mark.parametrize("update", [qwen3_5.causal_conv1d_update,
                                    modeling_lfm2.causal_conv1d_update], ids=["qwen3_5", "lfm2"])
def test_conv_decode_matches_transformers_per_slot(update):
    """One input for each of three sequences in slots 3, 1, 0: each gets transformers'
    one-token update of its own window; the other slots stay as they were."""
    x, weight, bias = conv_inputs(3)
    pool, slots = torch.randn(SLOTS, 12, 3), torch.tensor([3, 1, 0])
    before = pool.clone()
    out = reference.causal_conv1d_decode(x, pool, slots, weight, bias, "silu")
    for b, slot in enumerate(slots.tolist()):
        theirs = torch.cat((torch.zeros(12, 1), before[slot]), dim=1).unsqueeze(0)
        expected = update(x[b].view(1, 12, 1), theirs, weight, bias, "silu")
        torch.testing.assert_close(out[b], expected[0, :, 0], **FP32)
        torch.testing.assert_close(pool[slot], theirs[0, :, 1:])
    assert torch.equal(pool[[2, 4]], before[[2, 4]])


def test_conv_keeps_a_bf16_state_and_output():
    x, weight, bias = conv_inputs(6)
    pool = torch.zeros(SLOTS, 12, 3, dtype=torch.bfloat16)
    out = reference.causal_conv1d_prefill(x.bfloat16(), pool, 0, weight.bfloat16(), None, "silu")
    expected = qwen3_5.causal_conv1d_fn(x.T.unsqueeze(0), weight, None, activation="silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected[0].T, atol=3e-2, rtol=3e-2)
    assert torch.equal(pool[0], x[-3:].T.bfloat16())


def test_the_torch_backend_serves_the_reference():
    recurrent = TORCH_OPS.recurrent
    assert recurrent.gated_delta_rule_prefill is reference.gated_delta_rule_prefill
    assert recurrent.gated_delta_rule_decode is reference.gated_delta_rule_decode
    assert recurrent.causal_conv1d_prefill is reference.causal_conv1d_prefill
    assert recurrent.causal_conv1d_decode is reference.causal_conv1d_decode


def test_bad_shapes_are_refused_naming_the_argument():
    inputs = delta_rule_inputs(4, 2, 4)
    pool = state_pool(4, 16, 24)
    with pytest.raises(ValueError, match="state: needs shape"):
        reference.gated_delta_rule_prefill(**inputs, state=pool[:, :2], slot=0, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="slot -1: outside the pool's 5 slots"):
        reference.gated_delta_rule_prefill(**inputs, state=pool, slot=-1, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="torch.float32"):
        reference.gated_delta_rule_prefill(**inputs, state=pool.bfloat16(), slot=0,
                                           use_qk_l2norm=True)
    with pytest.raises(ValueError, match="v: needs shape"):
        reference.gated_delta_rule_prefill(**{**inputs, "v": inputs["v"][:, :3]}, state=pool,
                                           slot=0, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="beta: needs shape"):
        reference.gated_delta_rule_decode(**{**inputs, "beta": inputs["beta"][:2]}, state=pool,
                                          slots=torch.arange(4), use_qk_l2norm=True)
    x, weight, bias = conv_inputs(3)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        reference.causal_conv1d_prefill(x, torch.zeros(SLOTS, 12, 3), 0, weight, bias, "gelu")
    with pytest.raises(ValueError, match="conv_state: needs shape"):
        reference.causal_conv1d_decode(x, torch.zeros(SLOTS, 12, 4), torch.arange(3), weight,
                                       bias, None)
