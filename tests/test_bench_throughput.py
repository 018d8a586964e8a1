"""bench/throughput.py's accounting: the phases of a real engine's steps and the roofline that
its peers' ratios are read against."""

import sys
from pathlib import Path

import pytest

from kvscope import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
throughput = pytest.importorskip("throughput")


def test_phases_count_every_step_and_the_roofline_takes_each_steps_slower_limit(tiny_model):
    llm = LLM(str(tiny_model("llama").path), dtype="float32", max_num_batched_tokens=16)
    prompts = [[5 + i for i in range(n)] for n in (20, 7, 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 4)]
    with throughput.recorded_steps(llm.engine) as records:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    phases = throughput.phase_totals(records, llm.engine.runner)

    costs = phases["prefill"]["step_costs"] + phases["decode"]["step_costs"]
    assert len(costs) == len(records)
    # 39 prompt tokens and 13 output tokens, each decode step one token of each sequence it
    # runs: every token's layers are counted once.
    config = llm.engine.runner.hf_config
    head = 2 * config.vocab_size * config.hidden_size
    chunks = sum(len(record.chunks) for record in records)
    layer_flops = (sum(flops for flops, _ in costs) - chunks * head) / (39 + 13 - 3)
    assert layer_flops == int(layer_flops) > 0
    assert all(read > llm.engine.runner.weight_bytes for _, read in costs)

    results = {"kvscope": {"seconds": 2.0, "phases": phases}, "vllm": {"seconds": 3.0}}
    # A GEMM rate and a bandwidth that make some steps compute-bound and others not.
    gemm_rate, bandwidth = 1e9, 1e9 * sorted(f / r for f, r in costs)[len(costs) // 2]
    report = {"machine_roofline": {"large_gemm_gflop_s": gemm_rate / 1e9,
                                   "read_bandwidth_gb_s": bandwidth / 1e9},
              "ratios": {}}
    throughput.add_phase_rates(report, results)
    floor = sum(max(f / gemm_rate, r / bandwidth) for f, r in costs)
    # Step by step, not the totals' larger limit (which the mixed steps exceed).
    assert floor > 1.01 * max(sum(f for f, _ in costs) / gemm_rate, sum(r for _, r in costs) / bandwidth)
    assert report["roofline_seconds"] == pytest.approx(floor, abs=1e-3)
    assert results["kvscope"]["share_of_roofline_time"] == pytest.approx(floor / 2.0, abs=1e-3)
    assert report["ratios"]["best_possible_vs_vllm"] == pytest.approx(3.0 / floor, rel=1e-2)
    assert "step_costs" not in phases["prefill"]  # the report stays small
