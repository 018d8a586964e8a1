"""The torch backend: every op of KernelOps in plain PyTorch, on any device.

These twins are the fallback where no faster kernel runs and the oracle the tests hold
the C++ and Triton kernels to (paged attention, the KV store, the experts and the
recurrent layers' ops are kernels/reference.py's).
"""

import torch
import torch.nn.functional as F

from kvscope.kernels import reference
from kvscope.kernels.kernel_ops import KernelOps, RecurrentKernels


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        hidden = residual.add_(hidden)
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int, head_dim: int) -> None:
    # cos / sin cover the rotated dims of each head: all of them, or the first ones only
    # (partial rotary); the rest pass through.
    rows = qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)[..., :cos.shape[-1]]
    half = cos.shape[-1] // 2
    rotated = torch.cat((-rows[..., half:], rows[..., :half]), dim=-1)
    rows.copy_(rows * cos.unsqueeze(1) + rotated * sin.unsqueeze(1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, weight).float()


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's first largest logit and that token's log_softmax."""
    chosen = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logprobs.tolist()


REFERENCE_RECURRENT = RecurrentKernels(
    causal_conv1d_prefill=reference.causal_conv1d_prefill,
    causal_conv1d_decode=reference.causal_conv1d_decode,
    gated_delta_rule_prefill=reference.gated_delta_rule_prefill,
    gated_delta_rule_decode=reference.gated_delta_rule_decode)

TORCH_OPS = KernelOps(
    backend="torch", paged_attention=reference.paged_attention, store_kv=reference.store_kv,
    rms_norm=rms_norm, rotary_embedding=rotary_embedding, silu_and_mul=silu_and_mul,
    linear=F.linear, prepack_weight=None, logits=logits, greedy_tokens=greedy_tokens,
    read_words=reference.read_words, packed=None,
    moe_experts=reference.moe_experts, recurrent=REFERENCE_RECURRENT, decoder_stack=None)
