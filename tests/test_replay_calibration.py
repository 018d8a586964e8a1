"""Tests for the replay's self-calibrated step-cost model (engine/replay/calibration.py,
calibration_cache.py): `kvscope replay TRACE --simulate` with no cost model given."""

import json
import os
import shutil
from pathlib import Path

import pytest
from test_replay import mooncake_rows, timed_step, write_mooncake

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.replay import calibration_cache
from kvscope.engine.replay.calibration import (
    DECODE_BATCHES,
    OWN_TOKENS,
    PREFILL_TOKENS,
    calibration_config,
    calibration_plan,
    profile_steps,
)
from kvscope.engine.replay.cost_model import StepCost, fit_step_cost, step_features
from kvscope.engine.worker import profile_cache

COMMON = ["--config", "num_gpu_blocks_override=32", "dtype=float32", "device=cpu",
          "max_model_len=256"]


@pytest.fixture
def step_cost_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own: the calibrations it finds are the ones it made."""
    monkeypatch.setenv("KVSCOPE_PROFILE_CACHE", str(tmp_path / "profiles"))
    return tmp_path / "profiles" / "step_costs"


def simulate(capsys, trace: Path, model: Path, *flags: str) -> dict:
    from kvscope.cli import main

    main(["replay", str(trace), "--model", str(model), "--simulate", "--json", *COMMON, *flags])
    (run,) = json.loads(capsys.readouterr().out)
    assert run["mode"] == "simulated"
    return run


def test_a_trace_simulates_on_a_calibration_made_once_then_reused(
        tmp_path, tiny_chat_model_path, step_cost_cache, capsys) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(6))
    first = simulate(capsys, trace, tiny_chat_model_path, "--out", str(tmp_path / "out"))
    assert first["num_output_tokens"] == sum(r["output_length"] for r in mooncake_rows(6))
    made = first["cost_model"]
    (cached,) = step_cost_cache.iterdir()
    assert made["kind"] == "self-calibration" and made["path"] == str(cached)
    assert not made["reused"] and made["num_steps"] > 100 and 0 <= made["fit_error"] < 10
    assert made["made_at"] and made["calibration_s"] > 0
    report = (tmp_path / "out" / "report.html").read_text()
    assert f"step-cost model of run 1: self-calibration {cached}" in report
    stamp = cached.stat().st_mtime_ns

    again = simulate(capsys, trace, tiny_chat_model_path)
    assert again["cost_model"] == {**made, "reused": True,
                                   "description": made["description"] + " (reused from the cache)"}
    assert cached.stat().st_mtime_ns == stamp  # read, not profiled and written again
    assert again["makespan_s"] == pytest.approx(first["makespan_s"])

    fresh = simulate(capsys, trace, tiny_chat_model_path, "--recalibrate")["cost_model"]
    assert not fresh["reused"] and fresh["path"] == str(cached)
    assert cached.stat().st_mtime_ns != stamp


def test_a_changed_model_dtype_or_machine_calibrates_again(
        tmp_path, tiny_chat_model_path, step_cost_cache, capsys, monkeypatch) -> None:
    model = Path(shutil.copytree(tiny_chat_model_path, tmp_path / "model"))
    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(3))
    first = simulate(capsys, trace, model)["cost_model"]
    weights = model / "model.safetensors"
    later = weights.stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(later, later))  # the weights rewritten
    changed = simulate(capsys, trace, model)["cost_model"]
    assert not changed["reused"] and changed["path"] != first["path"]
    assert len(list(step_cost_cache.iterdir())) == 2
    assert not simulate(capsys, trace, model, "dtype=bfloat16")["cost_model"]["reused"]

    config = EngineConfig(model=str(model), dtype="float32", device="cpu")
    key = calibration_cache.calibration_key(config, {}, [])
    assert calibration_cache.calibration_key(config, {}, []) == key
    monkeypatch.setattr(profile_cache, "_device_name", lambda device: "another CPU")
    assert calibration_cache.calibration_key(config, {}, []) != key


def test_a_changed_kernel_build_changes_the_key(tiny_chat_model_path, cpu_kernel_ops,
                                                monkeypatch) -> None:
    config = EngineConfig(model=str(tiny_chat_model_path), dtype="float32", device="cpu")
    key = calibration_cache.calibration_key(config, {}, [])
    assert key["kernel_build"] is not None
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS_TARGET", "avx2")
    assert calibration_cache.calibration_key(config, {}, [])["kernel_build"] != \
        key["kernel_build"]


def test_the_profile_covers_prefill_sizes_decode_batches_and_context(make_engine,
                                                                       tiny_model) -> None:
    """The steps the cost model's features need: a prefill chunk of every planned size, a
    decode step of every planned batch, with short context and with long."""
    plan = calibration_plan(256)
    runner = make_engine("llama").runner
    config = calibration_config(EngineConfig(model=str(tiny_model("llama").path),
                                             dtype="float32", device="cpu"), plan)
    records, durations = profile_steps(EngineCore(config, runner=runner), plan)
    assert len(durations) == len(records) and min(durations) > 0
    prefills = {r.num_scheduled_tokens for r in records
                if len(r.chunks) == 1 and r.chunks[0][2] == "prefill"}
    assert {t for t in PREFILL_TOKENS if t < 256} <= prefills
    decode_context = {}  # batch -> the most context one of its decode steps read
    for record in records:
        tokens, decodes, context = step_features(record)
        if decodes == tokens:
            decode_context[decodes] = max(decode_context.get(decodes, 0), context)
    assert set(DECODE_BATCHES) <= set(decode_context)
    long_context = max(p.shared for p in plan)
    assert long_context == 128
    for batch in DECODE_BATCHES:
        assert decode_context[batch] >= batch * long_context
    # Every batch found the shared prefix cached: their prefills start behind it.
    starts = [chunk[3] for r in records for chunk in r.chunks
              if chunk[2] == "prefill" and chunk[4] == long_context + OWN_TOKENS]
    assert starts == [long_context] * sum(DECODE_BATCHES)


def test_a_given_cost_model_is_preferred_and_named(tmp_path, tiny_chat_model_path,
                                                   step_cost_cache, capsys) -> None:
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(3))
    cost = tmp_path / "cost.json"
    cost.write_text(StepCost(0.01, 1e-4, 0.0, 0.0, num_fit_steps=7, fit_error=0.05).to_json())
    run = simulate(capsys, trace, tiny_chat_model_path, "--cost-model", str(cost))
    assert run["cost_model"]["kind"] == "saved model" and run["cost_model"]["path"] == str(cost)
    assert run["cost_model"]["num_steps"] == 7 and run["cost_model"]["made_at"] is None
    assert not step_cost_cache.exists()  # no calibration ran
    with pytest.raises(SystemExit):
        simulate(capsys, trace, tiny_chat_model_path, "--cost-model", str(cost), "--recalibrate")
    assert f"recalibrate: the simulation uses the saved model {cost}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--recalibrate"])
    assert "recalibrate: only a simulated replay" in capsys.readouterr().err


def test_a_relative_fit_recovers_known_coefficients_and_weighs_short_steps() -> None:
    """Exact times: both fits recover them. One long step measured twice as slow (a
    stall): the plain fit moves the short steps' predictions to absorb it (19 % off
    here), the relative one a third as far."""
    def seconds(tokens, decodes, context):
        return 0.002 + 1e-5 * tokens + 3e-4 * decodes + 2e-6 * context

    records = [timed_step(p, d, seconds) for p in (0, 16, 64) for d in (1, 4, 9)]
    model = fit_step_cost(records, relative=True)
    assert (model.intercept, model.per_token, model.per_decode, model.per_context_token) == \
        pytest.approx((0.002, 1e-5, 3e-4, 2e-6), rel=1e-6)
    slow = timed_step(400, 9, lambda *features: 2 * seconds(*features))
    short = timed_step(0, 4, seconds)
    errors = {relative: abs(fit_step_cost([*records, slow], relative=relative).step_time(short)
                            / short.duration - 1) for relative in (False, True)}
    assert errors[True] < errors[False] / 2
