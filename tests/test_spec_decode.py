"""Speculative decoding: greedy output equals speculation off token for token, proposals
are verified exactly, rejected proposals give their slots back."""

import random

import pytest

from kvscope.engine.sample.sampling_params import SamplingParams
from kvscope.engine.spec_decode.ngram_proposer import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
_rng = random.Random(5)


def _copy_prompt(length: int) -> list[int]:
    """A phrase repeated with variations: prompt lookup finds matches, some of them wrong."""
    phrase = [_rng.randrange(1, 256) for _ in range(12)]
    tokens = []
    while len(tokens) < length:
        tokens += [t if _rng.random() > 0.2 else _rng.randrange(1, 256) for t in phrase]
    return tokens[:length]


PROMPTS = [_copy_prompt(n) for n in (7, 30, 45, 64, 20, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def token_ids(run) -> list[list[list[int]]]:
    return [[c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in run.outputs]


def drafted(run) -> tuple[int, int]:
    """(tokens proposed, tokens accepted) over a run."""
    drafts = [d for record in run.records for d in record.spec_drafts]
    return sum(d[1] for d in drafts), sum(d[2] for d in drafts)


def test_ngram_proposer_takes_the_longest_latest_match():
    proposer = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert proposer.propose(tokens, 2) == [9, 2]  # "6 7" last seen at 5..6
    assert proposer.propose(tokens + [8], 3) == [1, 6, 7]  # "6 7 8" beats "7 8" and "8"
    assert proposer.propose([1, 2, 3], 4) == []
    assert NgramProposer(2, 2).propose([4, 4, 4], 4) == [4]  # the match runs into the end


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_greedy_output_equals_speculation_off(arch, make_engine, run_engine):
    off = run_engine(make_engine(arch, block_size=4), PROMPTS, GREEDY)
    on = run_engine(make_engine(arch, block_size=4, speculative_config=NGRAM), PROMPTS, GREEDY)

    assert token_ids(on) == token_ids(off)
    proposed, accepted = drafted(on)
    assert 0 < accepted < proposed  # both verdicts were exercised
    assert len(on.records) < len(off.records)
    assert on.records[-1].num_used_blocks == 0
