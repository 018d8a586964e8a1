"""bench/throughput.py's accounting: the phases of a real engine's steps and the roofline that
its peers' ratios are read against."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvscope import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import throughput  # noqa: E402  (bench/ is no package; a broken import there must fail here)


def test_phases_count_every_step_and_the_roofline_takes_each_steps_slower_limit(tiny_model):
    llm = LLM(str(tiny_model("llama").path), dtype="float32", max_num_batched_tokens=16)
    prompts = [[5 + i for i in range(n)] for n in (20, 7, 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 4)]
    with throughput.recorded_steps(llm.engine) as records:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.engine.runner
    phases = throughput.phase_totals(records, runner)

    # 39 prompt tokens, and 13 output tokens of which each sequence's first comes from its
    # prefill: every token's layers are counted once, and the head once per chunk.
    costs = [throughput.step_costs(runner)(record) for record in records]
    config = runner.hf_config
    head = 2 * config.vocab_size * config.hidden_size
    chunks = sum(len(record.chunks) for record in records)
    flops = phases["prefill"]["matmul_flops"] + phases["decode"]["matmul_flops"]
    assert flops == sum(f for f, _ in costs)
    assert (flops - chunks * head) % (39 + 13 - 3) == 0 and flops > chunks * head
    # Each chunk reads its sequence's K and V up to its end, in every layer (fp32).
    kv_per_token = (config.num_hidden_layers * 2 * config.num_key_value_heads
                    * config.hidden_size // config.num_attention_heads * 4)
    ends = {"prefill": 0, "decode": 0}
    for record in records:
        phase = "prefill" if any(kind == "prefill" for _, _, kind, _, _ in record.chunks) \
            else "decode"
        ends[phase] += sum(end for *_, end in record.chunks)
    assert ends["decode"] and ends["prefill"]  # both phases ran
    assert {name: phases[name]["kv_bytes"] for name in ends} == {
        name: total * kv_per_token for name, total in ends.items()}

    reads = [runner.weight_bytes + kv for _, kv in costs]
    # A GEMM rate and a bandwidth that make some steps compute-bound and others not.
    gemm_rate = 1e9
    bandwidth = gemm_rate * sorted(r / f for (f, _), r in zip(costs, reads))[len(costs) // 2]
    floor = sum(max(f / gemm_rate, r / bandwidth) for (f, _), r in zip(costs, reads))
    # Step by step, not the totals' larger limit (which the mixed steps exceed).
    assert floor > 1.01 * max(flops / gemm_rate, sum(reads) / bandwidth)

    results = {"kvscope": {"seconds": 2.0, "phases": phases}, "vllm": {"seconds": 3.0}}
    report = {"machine_roofline": {"large_gemm_gflop_s": gemm_rate / 1e9,
                                   "read_bandwidth_gb_s": bandwidth / 1e9},
              "ratios": {}}
    backends = {"kvscope": SimpleNamespace(records=records, llm=llm)}
    throughput.add_phase_rates(report, results, backends)
    assert report["roofline_seconds"] == pytest.approx(floor, abs=1e-3)
    assert results["kvscope"]["share_of_roofline_time"] == pytest.approx(floor / 2.0, abs=1e-3)
    assert results["vllm"]["share_of_roofline_time"] == pytest.approx(floor / 3.0, abs=1e-3)
    assert report["ratios"]["best_possible_vs_vllm"] == pytest.approx(3.0 / floor, rel=1e-2)


def test_a_single_stream_above_the_probes_limit_flags_the_probe_not_the_engine():
    roofline = throughput.roofline
    assert roofline.probe_check({"share_of_bandwidth_limit": 0.97,
                                 "share_of_weights_read_limit": 1.0}) == {"probe_beaten": False}
    verdict = roofline.probe_check({"share_of_bandwidth_limit": 1.08,
                                    "share_of_weights_read_limit": 0.99})
    assert verdict["probe_beaten"] is True
    assert "share_of_bandwidth_limit = 1.08" in verdict["probe_note"]
    assert "share_of_weights_read_limit" not in verdict["probe_note"]
