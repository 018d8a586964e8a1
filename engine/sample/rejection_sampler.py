"""Speculative decoding's exact verification (Leviathan et al., vLLM's RejectionSampler).

A proposed token d, drawn by the proposer from q, is accepted with probability
min(1, p(d) / q(d)), where p is the target model's distribution after every sampling
feature; if rejected, the token is drawn from the residual max(0, p - q), renormalized.
Every token y then comes out with probability exactly p(y). An n-gram proposal is
deterministic, so its q is one-hot at d: d is accepted with probability p(d) and the
residual is p without d. A greedy request's distribution is one-hot at the target's argmax,
so a proposal is accepted exactly when it is that argmax (the sampler checks that itself).
"""

import torch


def accept_or_residual(probs: torch.Tensor, draft_token_ids: torch.Tensor,
                       draft_probs: torch.Tensor | None, uniforms: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of target `probs` [rows, vocab] with one proposed token each: whether it
    is accepted (bool [rows], given one U[0, 1) per row) and the residual distribution to
    draw from where it is not (unnormalized [rows, vocab]; rows never all zero where a
    rejection is possible). `draft_probs` None: the proposals were deterministic (q
    one-hot)."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    target = probs[rows, draft_token_ids]
    if draft_probs is None:
        accepted = uniforms.to(target.dtype) < target  # q(d) = 1
        residual = probs.clone()
        residual[rows, draft_token_ids] = 0
    else:
        proposed = draft_probs[rows, draft_token_ids]
        accepted = uniforms.to(target.dtype) * proposed < target
        residual = (probs - draft_probs).clamp_(min=0)
    return accepted, residual
