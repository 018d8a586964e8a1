"""Beam search in the engine: transformers' beams and scores, shared blocks, no leaks."""

import random

import pytest
import torch

from kvscope import LLM
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.telemetry.pool_recorder import mirror_of

WIDTH = 4
MAX_TOKENS = 8
_rng = random.Random(3)
# Shorter than a block of 16, exactly one block, and several blocks plus a partial one.
PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (5, 16, 21)]


def hf_beams(model, prompt, eos=None, length_penalty=1.0, max_tokens=MAX_TOKENS):
    """transformers' beams (generated tokens, cut after EOS) and their scores, best first."""
    with torch.inference_mode():
        result = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, num_beams=WIDTH,
            num_return_sequences=WIDTH, do_sample=False, early_stopping=True,
            length_penalty=length_penalty, eos_token_id=eos,
            pad_token_id=None if eos is None else eos,
            output_scores=True, return_dict_in_generate=True)
    beams = []
    for sequence in result.sequences:
        tokens = sequence[len(prompt):].tolist()
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos) + 1]
        beams.append(tokens)
    return beams, result.sequences_scores.tolist()


def run_beam_search(engine, prompt, params, on_step=None):
    """Step one beam-search request to the end; on_step(engine) runs after every step."""
    request_id = engine.add_request(prompt, params).request_id
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.request_id == request_id and output.finished:
                final = output
        if on_step is not None:
            on_step(engine)
    assert final is not None
    return final


def scores(output, length_penalty=1.0):
    return [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in output.outputs]


@pytest.mark.parametrize("block_size", [4, 16])
def test_beams_and_scores_equal_transformers(block_size, make_engine, tiny_model):
    model = tiny_model("llama").hf_model
    engine = make_engine("llama", block_size=block_size)
    for prompt in PROMPTS:
        expected, expected_scores = hf_beams(model, prompt)
        output = run_beam_search(engine, prompt, BeamSearchParams(WIDTH, MAX_TOKENS))

        assert [c.token_ids for c in output.outputs] == expected
        assert scores(output) == pytest.approx(expected_scores, abs=1e-4)
        assert all(c.finish_reason == "length" for c in output.outputs)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beams_ending_in_eos_equal_transformers(length_penalty, make_engine, tiny_model,
                                                monkeypatch):
    """Beams that finish at EOS at different lengths compete, by length-penalised score,
    with the beams cut at max_tokens, as in transformers with early_stopping=True."""
    model = tiny_model("llama").hf_model
    engine = make_engine("llama", block_size=4)
    prompt = PROMPTS[2]
    free_run, _ = hf_beams(model, prompt)
    # Tokens the beams pick early on: as EOS they end some beams well before max_tokens.
    eos_candidates = sorted({beam[i] for beam in free_run for i in (1, 3, 5)})[:3]
    num_ended_early = 0
    for eos in eos_candidates:
        monkeypatch.setattr(engine, "eos_token_ids", {eos})
        expected, expected_scores = hf_beams(model, prompt, eos, length_penalty)
        output = run_beam_search(
            engine, prompt, BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty=length_penalty))

        assert [c.token_ids for c in output.outputs] == expected
        assert scores(output, length_penalty) == pytest.approx(expected_scores, abs=1e-4)
        for completion in output.outputs:
            ended_by_eos = completion.token_ids[-1] == eos
            assert completion.finish_reason == ("stop" if ended_by_eos else "length")
            num_ended_early += len(completion.token_ids) < MAX_TOKENS
    if length_penalty < 2:  # (a strong penalty favours the long beams: none may survive)
        assert num_ended_early > 0  # the EOS choices did make beams of different lengths
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_beams_share_their_history_and_release_every_block(make_engine):
    engine = make_engine("llama", block_size=4)
    prompt = PROMPTS[2]  # 21 tokens: 5 full blocks and a partial one
    prompt_blocks = -(-len(prompt) // 4)
    seen = []

    def check(engine):
        snapshot = mirror_of(engine).snapshot()
        beams = snapshot.sequences
        if len(beams) < 2:
            return
        held = sum(len(s.block_table) for s in beams)
        in_use = sum(1 for b in snapshot.blocks if b.ref_count > 0)
        # Ref counts are exactly the block tables that hold each block.
        assert all(b.ref_count == len(b.owners) for b in snapshot.blocks)
        # Every beam descends from one prompt: its full blocks are held once, by all beams.
        full = set.intersection(*(set(s.block_table[:len(prompt) // 4]) for s in beams))
        assert len(full) == len(prompt) // 4
        assert all(snapshot.blocks[b].ref_count == len(beams) for b in full)
        seen.append((held, in_use, snapshot.blocks_saved_by_sharing))

    run_beam_search(engine, prompt, BeamSearchParams(WIDTH, 12), on_step=check)

    assert seen, "the search never had two live beams"
    for held, in_use, saved in seen:
        assert saved == held - in_use > 0
        # Fewer blocks than WIDTH separate copies of the prompt and the generated tokens.
        assert in_use < WIDTH * prompt_blocks
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize(("preemption_mode", "enable_prefix_caching"),
                         [("recompute", True), ("recompute", False), ("swap", True)])
def test_beams_survive_preemption(preemption_mode, enable_prefix_caching, make_engine,
                                  tiny_model):
    """Two searches in a pool too small for both: beams are preempted and resumed, and the
    result is still transformers'. A resumed beam may no longer share its prompt blocks
    (swapped back in, or recomputed without the prefix cache), so its idle siblings must
    make room for it instead of waiting for it forever."""
    model = tiny_model("llama").hf_model
    engine = make_engine("llama", block_size=4, num_gpu_blocks_override=16, max_model_len=40,
                         max_num_batched_tokens=64, preemption_mode=preemption_mode,
                         swap_space=0.001, enable_prefix_caching=enable_prefix_caching)
    prompts = [PROMPTS[2], PROMPTS[1]]
    ids = [engine.add_request(p, BeamSearchParams(WIDTH, 10)).request_id for p in prompts]
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    else:
        pytest.fail("the searches never finished (a blocked beam and idle siblings deadlock)")

    assert engine.scheduler.num_preemptions > 0
    if preemption_mode == "swap":
        assert engine.kv_cache.swap_stats.swap_outs > 0
    for prompt, request_id in zip(prompts, ids):
        expected, _ = hf_beams(model, prompt, max_tokens=10)
        assert [c.token_ids for c in finished[request_id].outputs] == expected
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert len(engine.kv_cache.free_swap_blocks) == engine.kv_cache.num_swap_blocks


def test_llm_beam_search_returns_the_best_width_beams_best_first(tiny_model):
    llm = LLM(str(tiny_model("llama").path), dtype="float32", device="cpu",
              device_memory_gb=0.05, max_model_len=64, max_num_batched_tokens=64)
    outputs = llm.beam_search(PROMPTS[:2], BeamSearchParams(WIDTH, MAX_TOKENS), use_tqdm=False)

    model = tiny_model("llama").hf_model
    for prompt, output in zip(PROMPTS, outputs):
        assert output.finished and output.prompt_token_ids == prompt
        assert [c.token_ids for c in output.outputs] == hf_beams(model, prompt)[0]
        assert scores(output) == sorted(scores(output), reverse=True)
    assert llm.engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("width", [0, -1, True, 2.0])
def test_beam_width_below_one_is_refused(width):
    with pytest.raises(ValueError, match="beam_width="):
        BeamSearchParams(width, MAX_TOKENS)


def test_beam_width_too_wide_for_the_pool_is_refused_and_the_engine_keeps_working(make_engine):
    engine = make_engine("llama", block_size=16, num_gpu_blocks_override=4, max_model_len=64,
                         max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"beam_width.*needs \d+ KV blocks.*pool has 4"):
        engine.add_request(PROMPTS[2], BeamSearchParams(8, MAX_TOKENS))
    assert not engine.has_unfinished_requests()
    output = run_beam_search(engine, PROMPTS[0], BeamSearchParams(2, MAX_TOKENS))
    assert len(output.outputs) == 2
    assert engine.kv_cache.pool.num_used_blocks == 0
