"""The small ops around a Llama-family layer's matmuls, fused (C++ on the CPU) or eager.

Eager PyTorch spends more time dispatching a decode step's ~1,300 small ops than
computing them; the fused versions do each group in one call:

  rms_norm(hidden, weight, eps, residual=None) -> normed
      with a residual: residual += hidden first (in place) and the sum is normalised
  rotary_embedding(qkv, cos, sin, heads, head_dim)
      neox rotary embedding in place on the first `heads` heads of each qkv row;
      cos / sin are fp32 [tokens, head_dim]
  silu_and_mul(x) -> silu(x[:, :n]) * x[:, n:]
  linear(x, weight, bias) -> x @ weight.T + bias
      one row (a single stream's decode) streams the weights through a dot-product
      kernel: oneDNN's bf16 matmul reads them at well under the memory bandwidth there
  logits(hidden, weight) -> (hidden @ weight.T).float()
      the output projection in the model's dtype, handed over in fp32; the kernel writes
      one row's fp32 values itself (torch's conversion woke its OpenMP threads for it)

`TORCH_OPS` is the eager twin (any device, and the oracle); `CPU_OPS` calls the C++
kernels (kernels/csrc/fused_cpu.cpp), which compute in fp32 and round where eager does.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ForwardOps:
    name: str
    rms_norm: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        hidden = residual.add_(hidden)
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _torch_rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            heads: int, head_dim: int) -> None:
    rows = qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-rows[..., half:], rows[..., :half]), dim=-1)
    rows.copy_(rows * cos.unsqueeze(1) + rotated * sin.unsqueeze(1))


def _torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _torch_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, weight).float()


TORCH_OPS = ForwardOps("torch", _torch_rms_norm, _torch_rotary_embedding, _torch_silu_and_mul,
                       F.linear, _torch_logits)


def _cpu_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(hidden)
    torch.ops.kvscope.rms_norm(hidden, weight, eps, out, residual)
    return out


def _cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.kvscope.silu_and_mul(x, out)
    return out


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One row through the streaming kernel, more rows through F.linear; out_dtype float32
    widens the result (the kernel writes it so itself)."""
    if x.shape[0] != 1 or x.dim() != 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias).to(out_dtype or x.dtype)
    out = x.new_empty(1, weight.shape[0], dtype=out_dtype or x.dtype)
    torch.ops.kvscope.linear_small_batch(x, weight, bias, out)
    return out


def _cpu_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _cpu_linear(hidden, weight, out_dtype=torch.float32)


def cpu_ops() -> ForwardOps:
    """The C++ versions (builds or loads the extension; raises RuntimeError if it cannot)."""
    from kvscope.kernels import cpu_ops as extension

    extension.load()
    return ForwardOps("cpu", _cpu_rms_norm, torch.ops.kvscope.rotary_embedding.default,
                      _cpu_silu_and_mul, _cpu_linear, _cpu_logits)
