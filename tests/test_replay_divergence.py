"""Tests for engine/replay/divergence.py: where a simulated pool parts from a live one."""

import csv
import io
import json

from test_replay import STEADY_COST, mooncake_rows, write_mooncake

from kvscope.engine.config import EngineConfig
from kvscope.engine.replay.cost_model import StepCost
from kvscope.engine.replay.divergence import first_divergence, pool_divergence
from kvscope.engine.replay.runner import ReplaySession
from kvscope.engine.replay.traces import load_trace
from kvscope.engine.worker.loader import load_tokenizer


def test_runs_on_one_clock_agree_and_a_slower_clock_parts_at_an_admission(
        tmp_path, tiny_model) -> None:
    """Two simulations (any two runs compare alike): on the same cost model every step
    agrees; on one twice as slow, the second step admits more of the requests that arrive
    every 3 ms, and the first divergence names the earliest of them (mooncake-6, not
    mooncake-10, which sorts first by name)."""
    model = tiny_model("llama").path
    rows = [{"timestamp": 3 * i, "input_length": 40, "output_length": 6, "hash_ids": [i]}
            for i in range(12)]
    workload = load_trace(write_mooncake(tmp_path / "t.jsonl", rows), load_tokenizer(model))
    session = ReplaySession(workload, EngineConfig(model=str(model), block_size=8,
                                                   num_gpu_blocks_override=64),
                            cost_model=STEADY_COST)
    reference = session.run({}, "simulated")
    assert first_divergence(reference, session.run({}, "simulated")) is None
    session.cost_model = StepCost(*(2 * value for value in (0.01, 1e-4, 0.0, 0.0)))
    slower = session.run({}, "simulated")
    steps = pool_divergence(reference, slower)
    assert len(steps) == max(len(reference.records), len(slower.records))
    assert steps[0]["same"] and not steps[1]["same"]
    divergence = first_divergence(reference, slower)
    assert (divergence.step, divergence.what) == (1, "admission")
    # After step 0 (0.014 s on the reference clock, 0.028 s on the slower one) the slower
    # run admits the request arriving at 0.015 s; the reference waits a step for it.
    assert divergence.cause.startswith("request mooncake-6 arrived at 0.015 s; live ran it "
                                       "first in step 2 (its clock 0.0")


def test_kvscope_replay_against_live_reports_the_first_divergence(
        tmp_path, tiny_chat_model_path, capsys) -> None:
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(4))
    cost = tmp_path / "cost.json"
    cost.write_text(STEADY_COST.to_json())
    main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--simulate",
          "--cost-model", str(cost), "--against-live", "--json", "--out", str(tmp_path / "out"),
          "--config", "num_gpu_blocks_override=32", "dtype=float32", "device=cpu"])
    simulated, live = json.loads(capsys.readouterr().out)
    assert (simulated["mode"], live["mode"]) == ("simulated", "live")
    assert "first_divergence" in simulated and "first_divergence" not in live
    table = list(csv.DictReader(io.StringIO((tmp_path / "out" / "divergence.csv").read_text())))
    assert len(table) == max(simulated["num_steps"], live["num_steps"])
    assert {"label", "step", "live_num_used_blocks", "simulated_prefix_cache_hits",
            "same"} <= set(table[0])
