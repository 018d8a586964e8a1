"""Rejection sampling keeps the target's distribution: empirical frequencies of many draws
against exact probabilities, on the sampler alone and through the engine."""

import shutil

import pytest
import torch
from conftest import noisy_output_copy, save_tiny_model_files

from kvscope.engine.sample.sampler import sample
from kvscope.engine.sampling_params import SamplingParams

# Every token's empirical frequency lies within this many standard deviations of its exact
# probability (sqrt(p (1 - p) / N)), plus an absolute slack for the float32 arithmetic.
# For a correct sampler the chance of one of ~256 tokens straying past 5 sigma is ~1e-4.
SIGMAS = 5.0
SLACK = 2e-3


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    n = tokens.numel()
    frequency = counts / n
    sigma = (probs * (1 - probs) / n).sqrt()
    worst = ((frequency - probs).abs() - SLACK - SIGMAS * sigma).max().item()
    assert worst <= 0, f"a frequency strays {worst:.4f} past the bound"


@pytest.mark.parametrize("deterministic_drafts", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_verified_tokens_follow_the_target_distribution(deterministic_drafts, params):
    """Proposals drawn from a draft distribution q (or fixed, q one-hot) and verified
    against target logits come out distributed as the target's filtered distribution."""
    generator = torch.Generator().manual_seed(3)
    vocab, rows = 12, 60_000
    target_logits = torch.randn(vocab, generator=generator) * 2
    draft_probs = torch.softmax(torch.randn(vocab, generator=generator) * 2, dim=-1)
    if deterministic_drafts:
        drafts, q = torch.full((rows,), int(target_logits.argsort()[-2])), None
    else:
        drafts = torch.multinomial(draft_probs, rows, replacement=True, generator=generator)
        q = draft_probs.expand(rows, -1)
    logits = target_logits.expand(rows, -1).contiguous()
    result = sample(logits, [params] * rows, [None] * rows, generator,
                    draft_token_ids=drafts.tolist(), draft_probs=q)

    reference = sample(logits, [params] * rows, [None] * rows, generator)  # no proposals
    exact = torch.bincount(torch.tensor(reference.token_ids), minlength=vocab) > 0
    tokens = torch.tensor(result.token_ids)
    assert exact[tokens].all()  # only tokens the filters keep
    probs = _filtered(target_logits, params)
    assert_follows(tokens, probs)
    accepted = (tokens == drafts).double().mean().item()
    expected = (torch.minimum(probs, draft_probs).sum() if q is not None
                else probs[drafts[0]]).item()
    assert accepted == pytest.approx(expected, abs=0.01)


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution after temperature, top-k, then top-p over what top-k
    kept (vLLM's order), computed plainly."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if params.top_k > 0:
        order = order[:params.top_k]
    total = probs[order].sum().item()
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in order:
        if mass >= params.top_p:
            break
        keep[token] = True
        mass += probs[token].item() / total
    probs = probs * keep
    return probs / probs.sum()


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(dim=-1).tolist()
    drafts = [best[0], best[1] + 1 if best[1] < 19 else 0, -1, best[3], 0, best[5]]
    result = sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6,
                    draft_token_ids=drafts)
    assert result.token_ids == best


@pytest.fixture(scope="module")
def peaked_model(tiny_model, tmp_path_factory):
    """The tiny Llama with its output projection scaled up: at temperature 1 its next
    token concentrates on a handful of tokens, so proposals are often accepted and often
    rejected."""
    tiny = tiny_model("llama")
    folder = tmp_path_factory.mktemp("peaked-llama")
    for item in tiny.path.iterdir():
        shutil.copy(item, folder)
    model = type(tiny.hf_model)(tiny.hf_model.config)
    model.load_state_dict(tiny.hf_model.state_dict())
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
    model.save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def peaked_draft(peaked_model, tmp_path_factory):
    """The peaked model with noise on its output projection: a draft model whose q differs
    from the target's p, so its proposals are accepted sometimes, not always."""
    folder, target = peaked_model
    draft_folder = tmp_path_factory.mktemp("peaked-draft")
    save_tiny_model_files(noisy_output_copy(target, std=0.15, seed=4), draft_folder)
    return draft_folder


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_second_token_follows_the_target_marginal(method, peaked_model, peaked_draft):
    """4,096 samples of 3 tokens at temperature 1, the second token verified against a
    proposal: prompt lookup's wherever the first occurs in the prompt (q one-hot), or a
    draft model's draw from its own distribution q. Its frequencies match the exact
    marginal sum_t1 p(t1) p(t2 | t1) of the transformers model."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.engine_core import EngineCore

    folder, hf_model = peaked_model
    proposals = ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1}
                 if method == "ngram" else {"method": "draft_model", "model": str(peaked_draft)})
    with torch.no_grad():
        # The model's own sampled text: its transitions are ones it likes, so the proposals
        # looked up in it are often (not always) accepted.
        torch.manual_seed(0)
        prompt = hf_model.generate(torch.tensor([[5, 6]]), do_sample=True, max_new_tokens=150,
                                   min_new_tokens=150, top_k=0)[0].tolist()
        first = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        contexts = torch.tensor([prompt + [t] for t in range(256)])
        second = torch.softmax(hf_model(contexts).logits[:, -1].double(), -1)
    marginal = first @ second

    engine = EngineCore(EngineConfig(
        model=str(folder), dtype="float32", device="cpu", device_memory_gb=0.05,
        max_num_seqs=256, speculative_config={
            **proposals, "num_speculative_tokens": 1, "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0, "adaptive_k": False}))
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=256)
    for _ in range(16):
        engine.add_request(prompt, params)
    seconds, proposed, accepted = [], 0, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        proposed += sum(d[1] for d in result.record.spec_drafts)
        accepted += sum(d[2] for d in result.record.spec_drafts)
        seconds += [c.token_ids[1] for o in result.outputs if o.finished for c in o.outputs]

    assert len(seconds) == 4096
    assert proposed > 1000 and 0.1 < accepted / proposed < 0.9
    assert_follows(torch.tensor(seconds), marginal)


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson's chi-square of drawn tokens against their expected counts, where token i
    was drawn from its own distribution probs[i] (a row per draw): the expected count of a
    token is its probability summed over the draws, and tokens expected fewer than 5 times
    share one cell. Returns (statistic, p-value, degrees of freedom). With draws from
    differing distributions each count varies less than a multinomial's, so the p-value is
    conservative: a correct sampler fails less often than it says."""
    expected = probs.sum(0)
    observed = torch.bincount(tokens, minlength=probs.shape[1]).double()
    rare = expected < 5
    expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    observed = torch.cat([observed[~rare], observed[rare].sum().view(1)])
    if expected[-1] == 0:
        expected, observed = expected[:-1], observed[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2)
    return statistic.item(), p_value.item(), dof


def test_engine_draft_model_k3_keeps_the_target_distribution_at_every_position(
        peaked_model, peaked_draft):
    """2,048 samples at temperature 0.8, each verifying a draft model's 3 proposals (drawn
    from its q) in one step: every token after the first, proposals 1..3 and the bonus
    token, is distributed as the target's p given the tokens before it (a chi-square test
    per position against the transformers model's conditional distributions, the engine's
    seed fixed)."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.engine_core import EngineCore

    folder, hf_model = peaked_model
    k, temperature, prompt = 3, 0.8, [5, 6, 7, 8, 9, 10]
    engine = EngineCore(EngineConfig(
        model=str(folder), dtype="float32", device="cpu", device_memory_gb=0.05,
        max_num_seqs=256, seed=0, speculative_config={
            "method": "draft_model", "model": str(peaked_draft), "num_speculative_tokens": k,
            "disable_by_batch_size": None, "min_acceptance_rate": 0.0, "adaptive_k": False}))
    params = SamplingParams(temperature=temperature, max_tokens=k + 2, ignore_eos=True, n=256)
    for _ in range(8):
        engine.add_request(prompt, params)
    samples, deep = [], 0
    while engine.has_unfinished_requests():
        result = engine.step()
        deep += sum(accepted >= 2 for _, _, accepted in result.record.spec_drafts)
        samples += [c.token_ids for o in result.outputs if o.finished for c in o.outputs]
    assert len(samples) == 2048
    assert deep > 250  # the third proposal was verified often

    tokens = torch.tensor(samples)
    with torch.no_grad():
        logits = hf_model(torch.cat([torch.tensor(prompt).expand(len(samples), -1),
                                     tokens[:, :-1]], dim=1)).logits
    # conditional[:, j]: the distribution of output token j given the prompt and those before
    conditional = torch.softmax(logits[:, len(prompt) - 1:].double() / temperature, dim=-1)
    for position in range(1, k + 2):
        statistic, p_value, dof = chi_square_p_value(tokens[:, position],
                                                     conditional[:, position])
        assert p_value > 1e-3, (
            f"output token {position + 1}: chi-square {statistic:.1f} over {dof} degrees of "
            f"freedom, p = {p_value:.2g}: not the target's distribution")
