"""Speculative decoding: greedy output equals speculation off token for token, proposals
are verified exactly, rejected proposals give their slots back."""

import random

import pytest

from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvscope.engine.spec_decode.ngram_proposer import NgramProposer
from kvscope.engine.spec_decode.proposer import Speculator
from kvscope.engine.spec_decode.step_cost import MIN_STEPS, StepCost
from kvscope.engine.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None, "min_acceptance_rate": 0.0,
         "adaptive_k": False}
_rng = random.Random(5)


def _copy_prompt(length: int, rng: random.Random = _rng) -> list[int]:
    """A phrase repeated with variations: prompt lookup finds matches, some of them wrong."""
    phrase = [rng.randrange(1, 256) for _ in range(12)]
    tokens = []
    while len(tokens) < length:
        tokens += [t if rng.random() > 0.2 else rng.randrange(1, 256) for t in phrase]
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


def _lookup_oracle(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup spelled out: for n from longest, the latest window equal to the last n."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_proposer_equals_the_spelled_out_lookup():
    rng = random.Random(3)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert NgramProposer(min_n, max_n).propose(tokens, k) == \
            _lookup_oracle(tokens, k, min_n, max_n), (tokens, min_n, max_n, k)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_greedy_output_equals_speculation_off(arch, make_engine, run_engine):
    off = run_engine(make_engine(arch, block_size=4), PROMPTS, GREEDY)
    on = run_engine(make_engine(arch, block_size=4, speculative_config=NGRAM), PROMPTS, GREEDY)

    assert token_ids(on) == token_ids(off)
    proposed, accepted = drafted(on)
    assert 0 < accepted < proposed  # both verdicts were exercised
    assert len(on.records) < len(off.records)
    assert on.records[-1].num_used_blocks == 0


# Nine blocks of eight: one sequence at max_model_len fits, the batch needs ~60.
PRESSURED = {"num_gpu_blocks_override": 9, "swap_space": 0.001}
SHORT_PROMPTS = [_copy_prompt(n) for n in (5, 16, 40, 33, 20, 9)]
MIXED = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=n) for n in (1, 2)] * 3


@pytest.mark.parametrize("budget", [5, 64])
@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_greedy_equality_holds_under_preemption_chunking_and_caching(
        preemption_mode, enable_prefix_caching, budget, make_engine, run_engine):
    """Chunked prefill with a budget smaller than a verification chunk, repeated
    preemption in both modes, the prefix cache on and off, and n=2."""
    knobs = {"block_size": 8, "max_model_len": 72, "max_num_batched_tokens": budget,
             "enable_prefix_caching": enable_prefix_caching}
    off = run_engine(make_engine("llama", **knobs), SHORT_PROMPTS, MIXED)
    engine = make_engine("llama", **knobs, **PRESSURED, preemption_mode=preemption_mode,
                         speculative_config=NGRAM)
    on = run_engine(engine, SHORT_PROMPTS, MIXED)

    assert token_ids(on) == token_ids(off)
    assert engine.scheduler.num_preemptions >= 2
    assert drafted(on)[1] > 0
    assert all(r.num_scheduled_tokens <= budget for r in on.records)
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert sorted(engine.kv_cache.free_swap_blocks) == list(range(engine.kv_cache.num_swap_blocks))


def test_beam_search_beside_speculation_is_unchanged(make_engine, run_engine):
    """Beam search ranks every candidate itself, so its beams propose nothing; the greedy
    request beside it still speculates."""
    params = [BeamSearchParams(3, 12), GREEDY]
    prompts = PROMPTS[1:3]
    off = run_engine(make_engine("llama", block_size=4), prompts, params)
    on = run_engine(make_engine("llama", block_size=4, speculative_config=NGRAM), prompts,
                    params)

    assert token_ids(on) == token_ids(off)
    assert [c.cumulative_logprob for c in on.outputs[0].outputs] == pytest.approx(
        [c.cumulative_logprob for c in off.outputs[0].outputs])
    assert all(d[0].startswith(on.outputs[1].request_id) for r in on.records
               for d in r.spec_drafts)
    assert drafted(on)[0] > 0


FEATURES = {
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2},
    "logit_bias": {"logit_bias": {17: 3.0, 18: 2.0}},
    "min_tokens_and_stops": {"min_tokens": 12, "stop_token_ids": [17, 40], "stop": ["<18>"]},
    "logprobs": {"logprobs": 3},
    "allowed_and_bad_words": {"allowed_token_ids": list(range(1, 60)), "bad_words": ["<7>"]},
}


@pytest.mark.parametrize("knobs", FEATURES.values(), ids=FEATURES)
def test_sampling_features_apply_to_every_verified_position(knobs, make_engine, run_engine):
    """Each verified position sees the state its tokens before it left (penalty counts,
    min_tokens, stops), so greedy output, finish reasons and logprobs match speculation off."""
    params = SamplingParams(temperature=0, max_tokens=40, **knobs)
    off = run_engine(make_engine("llama", block_size=4), PROMPTS, params)
    on = run_engine(make_engine("llama", block_size=4, speculative_config=NGRAM), PROMPTS,
                    params)

    assert token_ids(on) == token_ids(off)
    for a, b in zip(on.outputs, off.outputs):
        assert [(c.text, c.finish_reason, c.stop_reason) for c in a.outputs] == \
            [(c.text, c.finish_reason, c.stop_reason) for c in b.outputs]
        if params.logprobs:
            for c, d in zip(a.outputs, b.outputs):
                assert [sorted(e) for e in c.logprobs] == [sorted(e) for e in d.logprobs]
                assert [v for e in c.logprobs for v in e.values()] == pytest.approx(
                    [v for e in d.logprobs for v in e.values()], abs=1e-4)
    assert drafted(on)[0] > 0


@pytest.mark.parametrize("structured", [{"regex": r"(ab-\d{3}, ){2,4}"},
                                        {"choice": ["ab-123, ab-123", "ab-124"]}],
                         ids=["regex", "choice"])
def test_structured_output_masks_apply_to_verified_positions(
        structured, tiny_byte_level_model_path, run_engine):
    """A proposal the grammar forbids has probability 0 and is rejected; the grammar only
    ever advances over tokens kept."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.engine_core import EngineCore

    def engine(**knobs):
        return EngineCore(EngineConfig(model=str(tiny_byte_level_model_path), dtype="float32",
                                       device="cpu", device_memory_gb=0.05, max_model_len=256,
                                       **knobs))

    prompts = ["codes: ab-123, ab-123, ab-124, ab-1", "ab-123, ab-12"]
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(**structured))
    off = run_engine(engine(), prompts, params)
    on = run_engine(engine(speculative_config=NGRAM), prompts, params)

    assert [c.text for o in on.outputs for c in o.outputs] == \
        [c.text for o in off.outputs for c in o.outputs]
    assert token_ids(on) == token_ids(off)
    assert drafted(on)[1] > 0


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["decoder-stack", "eager"])
def test_bfloat16_greedy_output_equals_speculation_off(tiny_model, run_engine, enforce_eager):
    """One stream in bf16: a verification chunk's rows compute bit for bit what decodes of
    those tokens compute (the streaming linears; the attention's decode path with each
    token's own KV splits), so greedy output and its logprobs are exactly equal, also where
    bf16 rounding makes near-ties. The prompts are long enough that decodes split their
    keys (with the prefill-style path for the chunk, two of these three drift apart).
    So is a batch of the three, whose verifications fit the streaming linears' rows; more
    rows go through GEMM, which rounds by batch shape."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.engine_core import EngineCore
    from kvscope.engine.worker.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_model("llama").path), dtype="bfloat16", device="cpu",
                          device_memory_gb=0.05, block_size=16, enforce_eager=enforce_eager)
    runner = ModelRunner(config)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    rng = random.Random(2)
    prompts = [_copy_prompt(n, rng) for n in (150, 180, 200)]
    accepted = 0
    for batch in [[prompt] for prompt in prompts] + [prompts]:
        off = run_engine(EngineCore(config, runner=runner), batch, params)
        on = run_engine(EngineCore(config.with_changes(speculative_config=NGRAM), runner=runner),
                        batch, params)
        assert token_ids(on) == token_ids(off)
        # The top logprobs, exactly: logits rows rounded apart show here.
        for on_output, off_output in zip(on.outputs, off.outputs, strict=True):
            assert on_output.outputs[0].logprobs == off_output.outputs[0].logprobs
        accepted += drafted(on)[1]
    assert accepted > 0


def test_low_acceptance_pauses_proposals_and_large_batches_propose_nothing(make_engine,
                                                                          run_engine):
    """A sequence whose recent proposals were accepted less than min_acceptance_rate sits
    out a pause: it verifies fewer proposals, a larger share of them accepted. With more
    sequences running than disable_by_batch_size, nobody proposes. Proposals cut to what
    the measured step cost pays for change no output either."""
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 256) for _ in range(40)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    eager_engine = make_engine("llama", speculative_config=NGRAM)
    eager = run_engine(eager_engine, prompts, params)
    assert not eager_engine.speculator.step_cost.steps  # nothing reads a fit without adaptive_k
    adaptive = run_engine(make_engine("llama", speculative_config={
        **NGRAM, "min_acceptance_rate": 0.9}), prompts, params)
    capped = run_engine(make_engine("llama", speculative_config={
        **NGRAM, "disable_by_batch_size": 3}), prompts, params)
    engine = make_engine("llama", speculative_config={**NGRAM, "adaptive_k": True})
    cost_cut = run_engine(engine, prompts, params)

    assert token_ids(adaptive) == token_ids(eager) == token_ids(capped) == token_ids(cost_cut)
    # The step cost is fitted on decode steps only: their sequences and proposed tokens.
    decode_steps = [(len(r.chunks), sum(d[1] for d in r.spec_drafts)) for r in cost_cut.records
                    if all(chunk[2] == "decode" for chunk in r.chunks)]
    assert [step[:2] for step in engine.speculator.step_cost.steps] == decode_steps[-64:]
    proposed, accepted = drafted(eager)
    adaptive_proposed, adaptive_accepted = drafted(adaptive)
    assert adaptive_proposed < 0.9 * proposed
    assert adaptive_accepted / adaptive_proposed > accepted / proposed
    assert proposed > 0 and drafted(capped) == (0, 0)  # four ran together throughout


def _decoding_sequence(index: int) -> Sequence:
    """A sequence one token into its output whose prompt repeats a phrase: prompt lookup
    proposes four tokens for it."""
    phrase = [5 + index, 6, 7, 8, 9, 10]
    tokens = phrase * 4 + [5 + index]
    request = Request(f"r{index}", None, tokens[:-1], SamplingParams(max_tokens=100))
    seq = Sequence(f"r{index}-0", request, 0, tokens, len(tokens) - 1)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def _fitted_step_cost(fixed: float, per_sequence: float, per_proposal: float) -> StepCost:
    """A StepCost that saw decode steps of 1-8 sequences and 0-8 proposals timed exactly
    fixed + per_sequence * sequences + per_proposal * proposals."""
    cost = StepCost()
    for step in range(2 * MIN_STEPS):  # no proposals yet: nothing to fit, nothing cut
        cost.observe(1 + step % 8, 0, fixed + per_sequence * (1 + step % 8))
    assert cost.per_proposal is None and cost.worth(0.01, 100, 8, 0)
    for step in range(72):
        sequences, proposed = 1 + step % 8, step // 8
        cost.observe(sequences, proposed, fixed + per_sequence * sequences
                     + per_proposal * proposed)
    return cost


def test_step_cost_fits_a_steps_time_per_sequence_and_per_proposal():
    cost = _fitted_step_cost(0.010, 0.001, 0.002)
    assert cost.per_sequence == pytest.approx(0.001)
    assert cost.per_proposal == pytest.approx(0.002)
    assert cost.seconds(8, 4) == pytest.approx(0.026)
    # One stream (11 ms a step): a proposal yielding 0.5 tokens adds 18 % time for 50 %
    # tokens; 0.1 of a token does not pay.
    assert cost.worth(0.5, 1, 1, 0) and not cost.worth(0.1, 1, 1, 0)
    # Eight sequences (18 ms) yielding 8 tokens: a proposal must yield 8 * 2 / 18 = 0.89.
    assert cost.worth(0.9, 8, 8, 0) and not cost.worth(0.85, 8, 8, 0)
    for step in range(64):  # a window without proposals keeps their slope
        cost.observe(1 + step % 8, 0, 0.010 + 0.001 * (1 + step % 8))
    assert cost.per_proposal == pytest.approx(0.002)
    assert cost.center[1] == 0 and cost.seconds(8, 1) == pytest.approx(0.020)

    alone = StepCost()  # one sequence throughout: the proposals' slope alone
    for step in range(16):
        alone.observe(1, step % 5, 0.010 + 0.0015 * (step % 5))
    assert alone.per_sequence == 0 and alone.per_proposal == pytest.approx(0.0015)
    assert alone.seconds(1, 4) == pytest.approx(0.016)
    # Then a batch whose proposals are all cut: the time follows its size, while the
    # proposals' slope stays what one stream measured.
    for step in range(64):
        alone.observe(2 + step % 7, 0, 0.008 + 0.002 * (2 + step % 7))
    assert alone.per_proposal == pytest.approx(0.0015)
    assert alone.per_sequence == pytest.approx(0.002)
    assert alone.seconds(8, 0) == pytest.approx(0.024)


def test_adaptive_k_keeps_the_proposals_worth_their_rows():
    """Each proposed token adds a row and yields with the chance that it and the tokens
    before it are accepted: one stream keeps what pays, the first tokens; a batch of eight,
    whose rows cost as much as they yield, keeps none; acceptance seen raises k."""

    speculator = Speculator(SpeculativeConfig(**{**NGRAM, "adaptive_k": True}), 1000)
    speculator.step_cost = _fitted_step_cost(0.010, 0.001, 0.002)
    alone = _decoding_sequence(0)
    speculator.propose([alone])
    # Before any verification, each token is accepted with chance 0.5: 0.5 and 0.25 of a
    # token pay for 2 ms beside an 11-13 ms step, 0.125 does not.
    assert alone.spec_token_ids == [6, 7]

    batch = [_decoding_sequence(i) for i in range(8)]
    speculator.propose(batch)
    assert all(seq.spec_token_ids == [] for seq in batch)
    assert batch[0].spec_stats.acceptance == pytest.approx(0.5)  # faded toward the prior

    for _ in range(5):
        speculator.observe(alone, 4, 4)
    speculator.propose([alone])
    assert alone.spec_token_ids == [6, 7, 8, 9]


def test_the_dashboard_panel_shows_each_steps_accepted_and_rejected_tokens(make_engine,
                                                                           run_engine):
    from kvscope.ui.spec_decode import spec_decode_panel

    run = run_engine(make_engine("llama", block_size=4, speculative_config=NGRAM),
                     PROMPTS[:2], GREEDY)
    figure = spec_decode_panel(run.records)
    traces = {trace["name"]: trace for trace in figure["data"]}
    proposed, accepted = drafted(run)
    assert sum(traces["accepted"]["y"]) == accepted
    assert sum(traces["rejected"]["y"]) == proposed - accepted
    assert all(0 <= rate <= 1 for rate in traces["acceptance rate"]["y"])
    prefill = spec_decode_panel(run.records[:1])  # nothing proposed yet: the empty panel
    assert prefill["data"] == []
    assert prefill["layout"]["annotations"][0]["text"].startswith("No proposals verified")


def test_the_block_tables_outline_the_slots_each_verification_wrote_and_released(make_engine):
    """After each step, the block-table figure outlines the cells its verifications wrote:
    blocks whose written slots were all kept, blocks keeping some rejected (released)
    slots, and, past a table's end, the blocks freed for holding only rejected ones, as
    many as the pool got back."""
    from kvscope.engine.core.kv_events import BlocksReleased
    from kvscope.engine.telemetry.pool_recorder import mirror_of
    from kvscope.ui.figures import block_table_map
    from kvscope.ui.spec_decode import latest_verifications

    size = 4  # and a pool of 64 blocks, whose tables are drawn whole (x = logical index)
    engine = make_engine("llama", block_size=size, num_gpu_blocks_override=64,
                         speculative_config=NGRAM)
    released: list[int] = []
    engine.events.subscribe(lambda event: released.extend(event.block_ids)
                            if isinstance(event, BlocksReleased) else None)
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, GREEDY)
    seen = {"written, kept": 0, "rejected: slots released": 0, "rejected: block freed": 0}
    while engine.has_unfinished_requests():
        released.clear()
        record = engine.step().record
        mirror = mirror_of(engine)
        verified = latest_verifications([record], mirror.step)
        assert set(verified) == {seq_id for seq_id, _, _ in record.spec_drafts}
        marks = {trace["name"]: trace for trace in block_table_map(mirror, verified=verified)
                 ["data"] if trace["type"] == "scatter" and trace["name"] in seen}
        cells = {name: sorted(zip(trace["y"], trace["x"])) for name, trace in marks.items()}
        expected = {name: [] for name in seen}
        for seq in mirror.sequences:
            if seq.seq_id not in verified:
                continue
            v = verified[seq.seq_id]
            label = f"{seq.seq_id} ({seq.status})"
            table = len(seq.block_table)
            assert seq.num_computed_tokens == v.kept and table == -(-v.kept // size)
            for index in range(v.start // size, (v.end - 1) // size + 1):
                rejected = v.kept < v.end and (index + 1) * size > v.kept
                name = ("rejected: block freed" if index >= table else
                        "rejected: slots released" if rejected else "written, kept")
                expected[name].append((label, index))
        assert cells == {name: sorted(points) for name, points in expected.items() if points}
        if not record.finished:  # a finished request's blocks are released too
            assert len(expected["rejected: block freed"]) == len(released)
        for name in seen:
            seen[name] += len(expected[name])
    assert all(seen.values()), seen  # every kind of mark was drawn
    assert latest_verifications([record], mirror.step + 1) == {}  # another step's pool
