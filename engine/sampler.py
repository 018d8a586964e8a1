"""Token selection: greedy, temperature, min-p, top-k, top-p, per-sequence seeds, logprobs."""

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
    raw_logits: torch.Tensor | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [rows, vocab] (fp32), each row with its params.
    Logprobs come from `raw_logits` when given: the model's, before penalties, biases and
    masks edited `logits` (vLLM's default logprobs mode)."""
    log_probs = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
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
        if p.logprobs is not None:  # 0: the chosen token's logprob alone
            values, ids = log_probs[row].topk(p.logprobs)
            top[row] = dict(zip(ids.tolist(), values.tolist()))
    return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), top)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, then min-p, top-k and top-p masks (vLLM's order)."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    truncates = any(k < logits.shape[1] for k in top_k) or any(p < 1 for p in top_p)
    if any(p.min_p > 0 for p in params):
        # Drop tokens less likely than min_p times the most likely one.
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        dropped = probs < min_p * probs.amax(dim=-1, keepdim=True)
        if not truncates:  # renormalise what is left rather than a second softmax
            probs = probs.masked_fill(dropped, 0)
            return probs / probs.sum(dim=-1, keepdim=True)
        logits = logits.masked_fill(dropped, float("-inf"))
    if truncates:
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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[dict[int, float]]:
    """Per row: the logprob of `token_ids[row]` and the row's top-k alternatives (the
    prompt logprobs of a chunk: row i scores the token at the next position)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0],) * 2
    return [{**dict(zip(ids, values)), token: logprob}
            for ids, values, token, logprob in zip(top_ids.tolist(), top_values.tolist(),
                                                   token_ids, chosen.squeeze(1).tolist())]
