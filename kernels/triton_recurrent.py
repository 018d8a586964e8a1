"""Triton decode steps of the recurrent layers over their state slots: the causal conv and the
gated delta rule, one new token per sequence (contracts: kernels/reference.py
causal_conv1d_decode and gated_delta_rule_decode). A prefill runs the reference's chunked
form, whose work is matmuls that torch already runs well on a GPU."""

import os

import torch
import triton
import triton.language as tl

from kvscope.kernels import reference
from kvscope.kernels.kernel_ops import RecurrentKernels

# @triton.jit picks the interpreter at decoration time, so this is fixed at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Columns of the state a delta-rule program owns: its block of S [Dk, BLOCK] stays in
# registers between the read of S^T k and the write of the update.
DELTA_RULE_COLUMNS = 32
CONV_CHANNELS = 128  # channels a conv program takes


@triton.jit
def _delta_rule_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    VALUE_HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, COLUMNS: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
):
    """One program per (sequence, value head, block of COLUMNS state columns)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    columns = tl.program_id(2) * COLUMNS + tl.arange(0, COLUMNS)
    dims = tl.arange(0, DK_PAD)
    dim_mask, column_mask = dims < DK, columns < DV
    key_head = head // GROUP
    q = tl.load(q_ptr + row * stride_q_row + key_head * stride_q_head + dims, mask=dim_mask,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k_row + key_head * stride_k_head + dims, mask=dim_mask,
                other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + EPS)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
    q = q / tl.sqrt(DK * 1.0)
    item = row * VALUE_HEADS + head
    decay = tl.exp(tl.load(g_ptr + item).to(tl.float32))
    beta = tl.load(beta_ptr + item).to(tl.float32)
    slot = tl.load(slots_ptr + row)
    block = (state_ptr + (slot * VALUE_HEADS + head) * DK * DV + dims[:, None] * DV
             + columns[None, :])
    mask = dim_mask[:, None] & column_mask[None, :]
    s = tl.load(block, mask=mask, other=0.0) * decay
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + columns, mask=column_mask,
                other=0.0).to(tl.float32)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(block, s, mask=mask)
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + item * DV + columns, out.to(out_ptr.dtype.element_ty), mask=column_mask)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            use_qk_l2norm: bool) -> torch.Tensor:
    """Same contract as kernels.reference.gated_delta_rule_decode."""
    reference.check_delta_rule_shapes(q, k, v, g, beta, state)
    _check_contiguous("state", state)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    rows, value_heads, dv = v.shape
    dk = q.shape[2]
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    grid = (rows, value_heads, triton.cdiv(dv, DELTA_RULE_COLUMNS))
    _delta_rule_decode_kernel[grid](
        q, k, v, g.float().contiguous(), beta.float().contiguous(), state,
        slots.to(torch.int64).contiguous(), out, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), VALUE_HEADS=value_heads,
        GROUP=value_heads // q.shape[1], DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk),
        COLUMNS=DELTA_RULE_COLUMNS, L2NORM=use_qk_l2norm, EPS=reference.L2NORM_EPS)
    return out


@triton.jit
def _conv_decode_kernel(
    x_ptr, state_ptr, slots_ptr, weight_ptr, bias_ptr, out_ptr, stride_x_row,
    CHANNELS: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """One program per (sequence, block of BLOCK channels): the window's W-1 inputs and the
    new one against the weights, then the window shifted by one."""
    row = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    taps = tl.arange(0, WIDTH_PAD)
    channel_mask = channels < CHANNELS
    held_mask = channel_mask[:, None] & (taps[None, :] < WIDTH - 1)
    slot = tl.load(slots_ptr + row)
    window = state_ptr + (slot * CHANNELS + channels[:, None]) * (WIDTH - 1) + taps[None, :]
    held = tl.load(window, mask=held_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x_row + channels, mask=channel_mask, other=0.0)
    weight = tl.load(weight_ptr + channels[:, None] * WIDTH + taps[None, :],
                     mask=channel_mask[:, None] & (taps[None, :] < WIDTH), other=0.0).to(tl.float32)
    # tap W-1 is the new input: put x there
    inputs = tl.where(taps[None, :] == WIDTH - 1, x.to(tl.float32)[:, None], held)
    y = tl.sum(inputs * weight, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    # the window's next contents: taps 1..W-1 of the inputs, read again from memory before
    # they are overwritten (a register tensor has no shift)
    later = tl.load(window + 1, mask=channel_mask[:, None] & (taps[None, :] < WIDTH - 2),
                    other=0.0)
    shifted = tl.where(taps[None, :] == WIDTH - 2, x[:, None].to(later.dtype), later)
    tl.store(window, shifted.to(state_ptr.dtype.element_ty), mask=held_mask)
    tl.store(out_ptr + row * CHANNELS + channels, y.to(out_ptr.dtype.element_ty),
             mask=channel_mask)


def causal_conv1d_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None) -> torch.Tensor:
    """Same contract as kernels.reference.causal_conv1d_decode."""
    reference.check_conv_shapes(x, conv_state, weight, bias, activation)
    _check_contiguous("conv_state", conv_state)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, channels = x.shape
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (rows, triton.cdiv(channels, CONV_CHANNELS))
    _conv_decode_kernel[grid](
        x, conv_state, slots.to(torch.int64).contiguous(), weight.contiguous(),
        weight if bias is None else bias.contiguous(), out, x.stride(0), CHANNELS=channels,
        WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width), BLOCK=CONV_CHANNELS,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out


def _check_contiguous(name: str, pool: torch.Tensor) -> None:
    # the kernels address a slot's state by its shape alone
    if not pool.is_contiguous():
        raise ValueError(f"{name}: the Triton kernels need a contiguous pool of states")


RECURRENT = RecurrentKernels(
    causal_conv1d_prefill=reference.causal_conv1d_prefill,
    causal_conv1d_decode=causal_conv1d_decode,
    gated_delta_rule_prefill=reference.gated_delta_rule_prefill,
    gated_delta_rule_decode=gated_delta_rule_decode)
