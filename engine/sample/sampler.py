"""Token selection: greedy, temperature, min-p, top-k, top-p, per-sequence seeds, logprobs.

Random rows draw by inverse CDF: one uniform number per row, found in the row's cumulative
weights. That costs one pass over the vocabulary where the Gumbel trick (vLLM's
argmax(p / Exp(1))) costs an exponential draw per token, which on a CPU took longer than
everything else in the step's sampling put together. Rows whose only filter is min-p never
touch the whole vocabulary again after one comparison: their few surviving candidates are
gathered and drawn from directly.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.engine.sample.rejection_sampler import accept_or_residual
from kvscope.engine.sampling_params import SamplingParams
from kvscope.kernels import TORCH_OPS


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
    greedy_tokens: Callable[[torch.Tensor], tuple[list[int], list[float]]] = TORCH_OPS.greedy_tokens,
    draft_token_ids: list[int] | None = None,
    draft_probs: torch.Tensor | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [rows, vocab] (fp32), each row with its params.
    Logprobs come from `raw_logits` when given: the model's, before penalties, biases and
    masks edited `logits` (vLLM's default logprobs mode). A batch of greedy rows that asks
    for no alternatives, over the logits as the model gave them, is picked by
    `greedy_tokens` (the engine's kernels: the C++ one picks in one pass over each row).

    Speculative decoding: a row whose `draft_token_ids` entry is >= 0 verifies that
    proposed token (engine.sample.rejection_sampler; `draft_probs` [rows, vocab] is the
    proposer's distribution, None for deterministic proposals). The token picked is the
    proposal exactly when it was accepted, and follows the target's distribution either
    way."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if (len(greedy) == len(params) and all(p.logprobs is None for p in params)
            and (raw_logits is None or raw_logits is logits)):
        tokens, logprobs = greedy_tokens(logits)
        return SampleResult(tokens, logprobs, [None] * len(tokens))
    log_probs = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
    if len(greedy) == len(params):
        chosen = logits.argmax(dim=-1)
    else:
        chosen = torch.empty(len(params), dtype=torch.long, device=logits.device)
        if greedy:
            chosen[greedy] = logits[greedy].argmax(dim=-1)
        _draw_random_rows(logits, params, generators, default_generator, chosen,
                          draft_token_ids or [-1] * len(params), draft_probs)
    chosen_logprobs = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top = [None] * len(params)
    for row, p in enumerate(params):
        if p.logprobs is not None:  # 0: the chosen token's logprob alone
            values, ids = log_probs[row].topk(p.logprobs)
            top[row] = dict(zip(ids.tolist(), values.tolist()))
    return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), top)


def _draw_random_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    chosen: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
) -> None:
    """Write a draw into `chosen` for every non-greedy row: rows verifying a proposal by
    rejection sampling, rows filtered by min-p alone among their candidates, the others
    from their distribution over the vocabulary."""
    by_min_p, by_distribution, verifying = [], [], []
    for row, p in enumerate(params):
        if p.greedy:
            continue
        truncates = 0 < p.top_k < logits.shape[1] or p.top_p < 1
        if draft_token_ids[row] >= 0:
            verifying.append(row)
        else:
            (by_min_p if p.min_p > 0 and not truncates else by_distribution).append(row)
    for rows, draw in ((by_min_p, _draw_min_p_candidates), (by_distribution, _draw_filtered)):
        if rows:
            whole = len(rows) == logits.shape[0]  # no gather when every row goes one way
            chosen[rows] = draw(logits if whole else logits[rows], [params[i] for i in rows],
                                _uniforms([generators[i] for i in rows], default_generator,
                                          logits.device))
    if verifying:
        row_generators = [generators[i] for i in verifying]
        accept, resample = (_uniforms(row_generators, default_generator, logits.device)
                            for _ in range(2))
        chosen[verifying] = _draw_verified(
            logits[verifying], [params[i] for i in verifying],
            torch.tensor([draft_token_ids[i] for i in verifying], device=logits.device),
            None if draft_probs is None else draft_probs[verifying], accept, resample)


def _draw_verified(logits: torch.Tensor, params: list[SamplingParams], drafts: torch.Tensor,
                   draft_probs: torch.Tensor | None, accept_uniforms: torch.Tensor,
                   resample_uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's proposal where accepted, else a draw from the residual."""
    accepted, residual = accept_or_residual(_filtered_probs(logits, params), drafts,
                                            draft_probs, accept_uniforms)
    return torch.where(accepted, drafts, _inverse_cdf(residual, resample_uniforms))


def _uniforms(generators: list[torch.Generator | None], default_generator: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row (float64); a seeded row draws from its own generator, so
    its draws do not depend on what else is in the batch."""
    uniforms = torch.rand(len(generators), generator=default_generator, device=device,
                          dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand(1, generator=generator, device=device,
                                       dtype=torch.float64)[0]
    return uniforms


def _draw_filtered(logits: torch.Tensor, params: list[SamplingParams],
                   uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the vocabulary: the first token whose running probability exceeds
    the row's uniform share of the total. The target stays below the total, so the token
    found always adds probability: a masked token (probability 0) is never chosen."""
    return _inverse_cdf(_filtered_probs(logits, params), uniforms)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalized `weights` (consumed): the token at the row's uniform share
    of the total (an all-zero row, whose draw is never used, gives the last token)."""
    cumulative = weights.cumsum_(dim=-1)
    totals = cumulative[:, -1:]
    targets = torch.minimum(uniforms.to(totals.dtype).unsqueeze(1) * totals,
                            torch.nextafter(totals, torch.zeros_like(totals)))
    found = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    return found.clamp_(max=weights.shape[1] - 1)


def min_p_candidates(logits: torch.Tensor, params: list[SamplingParams]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens min-p keeps after temperature, as flat (row, token, weight) triples in
    row order. Kept means p >= min_p * p_max, i.e. logit / T >= max_logit / T + log(min_p);
    the weight exp((logit - max_logit) / T) >= min_p is proportional to the probability."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    log_min_p = torch.tensor([p.min_p for p in params], device=device).log().unsqueeze(1)
    top = logits.amax(dim=-1, keepdim=True)
    rows, tokens = (logits >= top + temperature * log_min_p).nonzero(as_tuple=True)
    weights = ((logits[rows, tokens] - top[rows, 0]) / temperature[rows, 0]).exp()
    return rows, tokens, weights


def _draw_min_p_candidates(logits: torch.Tensor, params: list[SamplingParams],
                           uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over every row's candidates at once: one float64 running sum over all
    of them (rows later in the batch keep their precision), each row's target placed in
    its own stretch of it (every row keeps at least its most likely token)."""
    rows, tokens, weights = min_p_candidates(logits, params)
    running = torch.cat([weights.new_zeros(1, dtype=torch.float64),
                         weights.double().cumsum(dim=0)])  # running[i]: weight before i
    counts = torch.bincount(rows, minlength=logits.shape[0])
    firsts = counts.cumsum(dim=0) - counts
    lasts = firsts + counts - 1
    before, through = running[firsts], running[lasts + 1]
    found = torch.searchsorted(running[1:], before + uniforms * (through - before), right=True)
    return tokens[found.clamp_(min=firsts, max=lasts)]  # rounding stays inside the row


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
    # `logits` is this function's own tensor by now: a softmax in place saves allocating
    # another [rows, vocab] one, which costs more in page faults than the extra passes.
    logits = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int
                   ) -> tuple[list[dict[int, float]], list[int]]:
    """Per row: the logprob of `token_ids[row]` and the row's top-k alternatives (the
    prompt logprobs of a chunk: row i scores the token at the next position), and the
    token's rank in its row (vLLM's: 1 + how many other tokens are at least as likely)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    ranks = (log_probs >= chosen).sum(dim=-1)
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0],) * 2
    entries = [{**dict(zip(ids, values)), token: logprob}
               for ids, values, token, logprob in zip(top_ids.tolist(), top_values.tolist(),
                                                      token_ids, chosen.squeeze(1).tolist())]
    return entries, ranks.tolist()
