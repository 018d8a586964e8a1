"""Token selection: greedy, temperature, top-k, top-p, per-sequence seeds, logprobs."""

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: log-probability of the chosen token, and the top-k alternatives if asked.
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [rows, vocab] (fp32), each row with its params."""
    log_probs = torch.log_softmax(logits, dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    chosen = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        random_rows = (~greedy).nonzero().squeeze(1)
        probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows.tolist()])
        chosen[random_rows] = _draw(probs, [generators[i] for i in random_rows.tolist()],
                                    default_generator)
    chosen_logprobs = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top = [None] * len(params)
    for row, p in enumerate(params):
        if p.logprobs:
            values, ids = log_probs[row].topk(p.logprobs)
            top[row] = dict(zip(ids.tolist(), values.tolist()))
    return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), top)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, then top-k and top-p masks (vLLM's order)."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if any(k < logits.shape[1] for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        keep = ranks < torch.tensor(top_k, device=logits.device).unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        # Keep the smallest set of top tokens whose mass reaches top_p (always the first).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep &= mass_before < torch.tensor(top_p, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)


def _draw(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample via argmax(p / Exp(1)) (the Gumbel trick vLLM uses); seeded rows use their own
    generator so their draws do not depend on what else is in the batch."""
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
