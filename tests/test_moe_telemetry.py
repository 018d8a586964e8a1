"""A mixture-of-experts model's routing in the step records (engine.telemetry.experts):
every step's tokens per expert reconcile with the tokens it ran, with async scheduling's
overlapped forwards too; the bytes read are the chosen experts', each once; a dense
model's records carry none."""

import numpy as np
import pytest
from conftest import TINY_VOCAB_SIZE

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.experts import recent_counts, step_counts
from kvscope.engine.worker.models.moe import sparse_layers

PROMPTS = [[(7 * i + 3) % (TINY_VOCAB_SIZE - 1) + 1 for i in range(n)] for n in (5, 23, 40)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_step_counts_its_tokens_times_top_k(async_scheduling, make_engine, tiny_model,
                                                  run_engine):
    config = tiny_model("qwen3-moe").hf_model.config
    engine = make_engine("qwen3-moe", max_num_batched_tokens=16,
                         async_scheduling=async_scheduling)
    layout = engine.expert_layout
    run = run_engine(engine, PROMPTS, PARAMS)
    layers = tuple(index for index, sparse in enumerate(sparse_layers(config)) if sparse)
    assert layout.layers == layers and layout.top_k == config.num_experts_per_tok
    routed = [record for record in run.records if record.num_scheduled_tokens]
    assert routed and len(routed) > len(PROMPTS)  # chunked prefills and decodes
    for record in routed:
        counts = step_counts(record)
        assert record.expert_layers == layers
        assert counts.shape == (len(layers), config.num_experts)
        assert counts.sum(axis=1).tolist() == [record.num_scheduled_tokens * layout.top_k] * len(
            layers), f"step {record.step}"
        chosen = (counts > 0).sum(axis=1)
        assert record.expert_bytes_read == int(chosen @ np.array(layout.bytes_per_expert))
        assert record.expert_bytes_all == config.num_experts * sum(layout.bytes_per_expert)
        assert 0 < record.expert_bytes_read <= record.expert_bytes_all
    assert all(not record.expert_tokens for record in run.records
               if not record.num_scheduled_tokens)
    window_layers, window, steps = recent_counts(run.records, steps=3)
    assert window_layers == layers and steps == 3
    assert np.array_equal(window, sum(step_counts(record) for record in routed[-3:]))


def test_a_decode_step_reads_only_its_tokens_experts(make_engine, run_engine):
    """One sequence decoding: each layer reads at most top_k experts, far from all."""
    engine = make_engine("qwen3-moe")
    run = run_engine(engine, PROMPTS[:1], PARAMS)
    layout = engine.expert_layout
    decode = run.records[-1]
    assert decode.num_scheduled_tokens == 1
    assert (step_counts(decode) > 0).sum(axis=1).tolist() == [layout.top_k] * len(layout.layers)
    assert decode.expert_bytes_read == layout.top_k * sum(layout.bytes_per_expert)


def test_a_dense_model_records_no_experts(make_engine, run_engine):
    engine = make_engine("llama")
    assert engine.expert_layout is None
    run = run_engine(engine, PROMPTS[:1], PARAMS)
    assert all(record.expert_tokens == () and record.expert_bytes_all == 0
               for record in run.records)
    assert recent_counts(run.records)[2] == 0
