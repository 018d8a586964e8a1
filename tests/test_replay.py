"""Tests for engine.replay: trace importers, live and simulated replay, and their agreement."""

import json
import shutil
import time
from pathlib import Path

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.replay.cost_model import RecordedStepTimes, StepCost, fit_step_cost
from kvscope.engine.replay.runner import ReplaySession, base_config, parse_knob
from kvscope.engine.replay.simulated_runner import SimulatedRunner
from kvscope.engine.replay.simulated_tier import GIB, TierWhatIf
from kvscope.engine.replay.traces import MOONCAKE_BLOCK_TOKENS, load_trace
from kvscope.engine.replay.workload import ReplayRequest
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import StepRecord
from kvscope.engine.worker.loader import load_tokenizer
from kvscope.storage import SessionLog, record_sessions
from kvscope.storage.replay_source import load_session_workload

# A step takes 10 ms plus 0.1 ms per token: the simulated clock of tests that need one.
STEADY_COST = StepCost(0.01, 1e-4, 0.0, 0.0)


def write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def long_context_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny Llama's config and tokenizer with 4096 positions: enough for Mooncake's
    512-token blocks in a simulated replay (which loads no weights)."""
    folder = tmp_path_factory.mktemp("long-context")
    source = tiny_model("llama").path
    for item in source.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---- importers ---------------------------------------------------------------------------
def test_mooncake_shared_hash_ids_become_shared_token_blocks(tmp_path, tiny_model) -> None:
    tokenizer = load_tokenizer(tiny_model("llama").path)
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 2500, "input_length": 300, "output_length": 2, "hash_ids": [4]}])
    a, b, c = load_trace(trace, tokenizer).requests
    assert [len(r.prompt_token_ids) for r in (a, b, c)] == [1024, 700, 300]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 1.5]
    assert [r.num_output_tokens for r in (a, b, c)] == [4, 3, 2]
    block = MOONCAKE_BLOCK_TOKENS
    assert a.prompt_token_ids[:block] == b.prompt_token_ids[:block]
    assert a.prompt_token_ids[block:block + 188] != b.prompt_token_ids[block:]
    assert c.prompt_token_ids != a.prompt_token_ids[:300]


def test_azure_csv_imports(tmp_path, tiny_model) -> None:
    tokenizer = load_tokenizer(tiny_model("llama").path)
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:48.1805900,96,7\n")
    first, second = load_trace(trace, tokenizer).requests
    assert (len(first.prompt_token_ids), first.num_output_tokens) == (374, 44)
    assert (len(second.prompt_token_ids), second.num_output_tokens) == (96, 7)
    assert second.arrival_s == pytest.approx(1.5)
    assert first.prompt_token_ids[:96] != second.prompt_token_ids


def test_sharegpt_turns_become_requests_over_the_conversation_so_far(
        tmp_path, tiny_chat_model_path) -> None:
    tokenizer = load_tokenizer(tiny_chat_model_path)
    trace = tmp_path / "sharegpt.json"
    trace.write_text(json.dumps([{"id": "x", "conversations": [
        {"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi!"},
        {"from": "human", "value": "how are you"}, {"from": "gpt", "value": "fine, thanks"}]}]))
    first, second = load_trace(trace, tokenizer, rate=2.0).requests
    assert (first.num_output_tokens, second.num_output_tokens) == (3, 12)  # one char a token
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.arrival_s > first.arrival_s == 0.0


@pytest.mark.parametrize(("name", "text", "message"), [
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 5, "hash_ids": [1]}\n',
     "line 2: field 'output_length' is missing"),
    ("t.jsonl", '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}\n',
     "line 1: field 'input_length' must be >= 1"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,4,2\n2.0,4,-1\n",
     "line 3: field 'GeneratedTokens' must be >= 1"),
    ("t.csv", "TIMESTAMP,ContextTokens\n1.0,4\n", "line 1: field 'GeneratedTokens' is missing"),
    ("t.json", '[{"conversations": [{"from": "human", "value": 3}]}]',
     "line 1: field 'conversations[0].value' must be text"),
])
def test_a_bad_trace_names_the_line_and_the_field(tmp_path, tiny_chat_model_path, name, text,
                                                   message) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_trace(tmp_path / name, load_tokenizer(tiny_chat_model_path))


def test_replay_params_force_the_recorded_length() -> None:
    request = ReplayRequest("r", 0.0, [1, 2], 7, SamplingParams(
        temperature=0, stop=["x"], max_tokens=100, logit_bias={3: 1.0}).to_dict())
    live, simulated = request.params(), request.params(simulated=True)
    assert (live.max_tokens, live.ignore_eos, live.stop_strings) == (7, True, ())
    assert live.logit_bias == {3: 1.0} and simulated.logit_bias is None
    assert parse_knob("block_size=32") == ("block_size", 32)
    assert parse_knob("long_prefill_token_threshold=none") == ("long_prefill_token_threshold",
                                                               None)
    assert parse_knob("preemption_mode=swap") == ("preemption_mode", "swap")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_knob("block_size")


# ---- simulated replay --------------------------------------------------------------------
def test_simulated_prefix_hits_fall_where_the_mooncake_trace_shares_blocks(
        tmp_path, long_context_model) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 4000, "input_length": 300, "output_length": 2, "hash_ids": [4]}])
    workload = load_trace(trace, load_tokenizer(long_context_model))
    session = ReplaySession(workload, EngineConfig(model=str(long_context_model),
                                                   num_gpu_blocks_override=4096),
                            cost_model=STEADY_COST)
    hits = [s.prefix_cache_hits for s in session.run({}, "simulated").steps]
    assert sum(hits) == MOONCAKE_BLOCK_TOKENS  # the second request reuses block 1, only
    no_cache = session.run({"enable_prefix_caching": False}, "simulated")
    assert sum(s.prefix_cache_hits for s in no_cache.steps) == 0


def timed_step(prefill: int, decodes: int, seconds) -> StepRecord:
    """A step of one prefill chunk and `decodes` decodes, taking seconds(tokens, decodes,
    context)."""
    chunks = ((("a", "a", "prefill", 0, prefill),) if prefill else ()) + tuple(
        ("d", f"d{i}", "decode", 50 + i, 51 + i) for i in range(decodes))
    tokens = prefill + decodes
    context = sum(chunk[4] for chunk in chunks)
    return StepRecord(0, 0.0, seconds(tokens, decodes, context), chunks, (), (), (), (), tokens,
                      64, 1, 0, 1, 1, 0)


def test_fitted_cost_model_recovers_known_coefficients(tiny_model) -> None:
    def seconds(tokens, decodes, context):
        return 0.002 + 1e-5 * tokens + 3e-4 * decodes + 2e-6 * context

    records = [timed_step(p, d, seconds) for p in (0, 16, 64) for d in (1, 4, 9)]
    model = fit_step_cost(records)
    assert model.intercept == pytest.approx(0.002, rel=1e-6)
    assert model.per_token == pytest.approx(1e-5, rel=1e-6)
    assert model.per_decode == pytest.approx(3e-4, rel=1e-6)
    assert model.per_context_token == pytest.approx(2e-6, rel=1e-6)
    with pytest.raises(ValueError, match="need at least"):
        fit_step_cost(records[:2])


def test_fitted_cost_model_follows_a_change_of_slope_in_scheduled_tokens() -> None:
    """Past 16 rows each row costs a sixth as much (a CPU engine's GEMM changes kernel with
    its row count). The fitted model predicts short and long steps, and
    past the longest it was fitted to (one straight line through these steps is 74 % off at
    3 rows and 9 % at 64)."""
    def seconds(tokens, decodes, context):
        return 0.03 + 6e-3 * min(tokens, 16) + 1e-3 * max(tokens - 16, 0) + 2e-3 * decodes

    records = [timed_step(p, d, seconds) for p in range(0, 48, 2) for d in range(1, 13)]
    model = fit_step_cost(records)
    assert 16 in dict(model.token_knots)
    for prefill, decodes in ((0, 3), (14, 2), (40, 10), (120, 8)):  # 128 rows: past every knot
        step = timed_step(prefill, decodes, seconds)
        assert model.step_time(step) == pytest.approx(step.duration, rel=1e-6)
    assert StepCost.from_json(model.to_json()) == model


# ---- live replay -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "olmo3", "gemma4", "lfm2", "qwen3_5"])
def test_the_simulator_groups_and_sizes_the_pool_as_the_model_runner(arch, make_engine,
                                                                      tiny_model) -> None:
    """From the config alone: Olmo 3's sliding and full groups; Gemma 4's two layer shapes
    (slots as wide as the widest) and its KV-shared layers, which own no cache; LFM2's and
    Qwen3.5's recurrent layers, which write no K/V either."""
    runner = make_engine(arch).runner
    simulator = SimulatedRunner(EngineConfig(model=str(tiny_model(arch).path), dtype="float32",
                                             device="cpu"))
    assert simulator.kv_groups == runner.kv_groups
    for kv_cache_dtype in ("auto", "int8"):
        assert simulator.bytes_per_block(4, kv_cache_dtype) == runner.bytes_per_block(
            4, kv_cache_dtype)


def test_simulated_and_live_allocate_the_same_blocks_given_the_same_step_times(
        tmp_path, tiny_model) -> None:
    """A small pool preempts; the simulation, clocked by the live run's own step times,
    admits, allocates, hits and preempts exactly as the live run did, step by step."""
    model = tiny_model("llama").path
    rows = [{"timestamp": 3 * i, "input_length": 40 + 7 * (i % 5),
             "output_length": 20 + i % 7, "hash_ids": [i % 3]} for i in range(16)]
    workload = load_trace(write_mooncake(tmp_path / "t.jsonl", rows), load_tokenizer(model))
    session = ReplaySession(workload, EngineConfig(
        model=str(model), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=24, max_num_seqs=8, max_model_len=128))
    live = session.run({}, "live")
    session.cost_model = RecordedStepTimes([s.duration_s for s in live.steps])
    simulated = session.run({}, "simulated")
    assert live.summary()["preemptions"] > 0
    assert [s.num_used_blocks for s in simulated.steps] == [s.num_used_blocks for s in live.steps]
    assert [r.chunks for r in simulated.records] == [r.chunks for r in live.records]
    assert [s.prefix_cache_hits for s in simulated.steps] == \
        [s.prefix_cache_hits for s in live.steps]
    assert [(r.request_id, r.first_token_s) for r in simulated.requests] == \
        [(r.request_id, pytest.approx(r.first_token_s)) for r in live.requests]


def record_session(log_path: Path, model_path: Path, requests: list) -> tuple[dict, dict]:
    """Serve (prompt, params) requests one after another on the tiny chat model with the
    session log recording; returns each request's first output tokens and the config.

    Each request is alone in the engine, so a replay meets the same schedule (requests that
    arrive within one step of each other may land a step apart when replayed: the replay's
    clock resolves arrivals to step boundaries). The gap between requests (0.3 s and the
    request's own time) exceeds what a request takes in a simulated replay clocked by
    STEADY_COST (about 0.1 s), whatever the machine's speed."""
    config = EngineConfig(model=str(model_path), dtype="float32", device="cpu",
                          block_size=4, num_gpu_blocks_override=64, max_model_len=256)
    engine = AsyncEngine.from_config(config)
    log = SessionLog(log_path)
    log.start_session(engine.config.to_dict(), engine.model_path)
    stop_recording = record_sessions(engine, log, poll_s=0.02)
    engine.start()
    recorded = {}
    for prompt, params in requests:
        stream = engine.submit(prompt, params)
        recorded[stream.request_id] = list(stream)[-1].outputs[0].token_ids
        time.sleep(0.3)
    engine.shutdown()
    stop_recording()
    log.close()
    return recorded, engine.config.to_dict()


def test_a_recorded_session_replayed_live_reproduces_its_outputs_and_steps(
        tmp_path, tiny_chat_model_path) -> None:
    recorded, config = record_session(tmp_path / "log.db", tiny_chat_model_path, [
        ("The quick brown fox", SamplingParams(temperature=0, max_tokens=9)),
        ("The quick brown fox jumps", SamplingParams(temperature=0, max_tokens=6)),
        ("seeded", SamplingParams(temperature=0.8, seed=5, max_tokens=5))])

    workload = load_session_workload(tmp_path / "log.db")
    assert workload.config == config
    replayed = ReplaySession(workload, base_config(workload)).run({}, "live")
    assert {r.request_id: r.output_token_ids for r in replayed.requests} == recorded
    assert [r.chunks for r in replayed.records] == [r.chunks for r in workload.steps]
    assert sum(r.prefix_cache_hits for r in replayed.records) == \
        sum(r.prefix_cache_hits for r in workload.steps) > 0
    # Simulated with a cost model fitted to the session's own steps, timed by STEADY_COST
    # rather than the wall clock (a loaded machine would tilt a fit to the real times):
    # the fit recovers those times, and the simulation meets the same schedule.
    synthetic = [STEADY_COST.step_time(step) for step in workload.steps]
    cost = fit_step_cost(workload.steps, synthetic)
    assert [cost.step_time(step) for step in workload.steps] == pytest.approx(synthetic)
    simulated = ReplaySession(workload, base_config(workload), cost).run({}, "simulated")
    assert [r.chunks for r in simulated.records] == [r.chunks for r in workload.steps]


def test_a_recorded_beam_search_replays_live_as_one_and_is_refused_simulated(
        tmp_path, tiny_chat_model_path) -> None:
    recorded, _ = record_session(tmp_path / "log.db", tiny_chat_model_path, [
        ("The quick brown fox", BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))])

    workload = load_session_workload(tmp_path / "log.db")
    (request,) = workload.requests
    assert request.sampling["beam_width"] == 3
    assert isinstance(request.params(), BeamSearchParams)
    replayed = ReplaySession(workload, base_config(workload)).run({}, "live")
    assert replayed.requests[0].output_token_ids == recorded[request.request_id]
    # The beams fork and share blocks as they did: the same schedule, step for step.
    assert [r.chunks for r in replayed.records] == [r.chunks for r in workload.steps]
    with pytest.raises(ValueError, match=rf"request {request.request_id}: beam search "
                                         r"\(beam_width=3\).*replay it live"):
        ReplaySession(workload, base_config(workload), STEADY_COST).run({}, "simulated")


def cycling_prefixes(count: int, rounds: int = 2) -> list[dict]:
    """`count` distinct 1,024-token prompts, each asked `rounds` times in turn, a second
    apart: with a pool smaller than two of them, LRU has evicted each before it returns."""
    return [{"timestamp": 1000 * (r * count + i), "input_length": 1024, "output_length": 2,
             "hash_ids": [i, 100 + i]} for r in range(rounds) for i in range(count)]


def test_a_simulated_disk_tier_turns_the_evicted_working_sets_misses_into_hits(
        tmp_path, long_context_model) -> None:
    workload = load_trace(write_mooncake(tmp_path / "t.jsonl", cycling_prefixes(6)),
                          load_tokenizer(long_context_model))
    session = ReplaySession(workload, EngineConfig(model=str(long_context_model),
                                                   block_size=16, num_gpu_blocks_override=100,
                                                   max_model_len=1100),
                            cost_model=STEADY_COST)
    without = session.run({}, "simulated")
    with_tier = session.run({}, "simulated", tier=TierWhatIf(20))
    returning = slice(6, 12)  # the second round's requests
    # Without the tier the pool (100 blocks) never holds a prompt (64 blocks) until it
    # returns; with it, each returning prompt loads every full block but its last token's.
    assert sum(s.prefix_cache_hits for s in without.steps) == 0
    full_blocks = (1024 - 1) // 16 * 16
    assert sum(s.prefix_cache_hits for s in with_tier.steps) == 6 * full_blocks
    assert with_tier.label == "base config + 20 GiB disk tier (simulated, 0.3 GB/s)"
    loaded = [r.ttft_s for r in with_tier.requests[returning]]
    computed = [r.ttft_s for r in without.requests[returning]]
    assert max(loaded) < min(computed)  # a tiny model's blocks load in microseconds
    # The load's time is on the clock: at 1 kB/s the same loads cost more than computing.
    slow = session.run({}, "simulated", tier=TierWhatIf(20, load_gbps=1e-6))
    assert min(r.ttft_s for r in slow.requests[returning]) > max(computed)
    assert [r.ttft_s for r in slow.requests[:6]] == [r.ttft_s for r in without.requests[:6]]
    # A tier of half the working set is LRU too: each prompt left it before it returned.
    half = 3 * 64 * SimulatedRunner(session.base).bytes_per_block(16) / GIB
    small = session.run({}, "simulated", tier=TierWhatIf(half))
    assert sum(s.prefix_cache_hits for s in small.steps) == 0
    with pytest.raises(ValueError, match="kv_offload_gb"):
        session.run({}, "live", tier=TierWhatIf(20))
    with pytest.raises(ValueError, match="kv_offload_gb=0"):
        TierWhatIf(0)


# ---- the command -------------------------------------------------------------------------
def mooncake_rows(count: int) -> list[dict]:
    return [{"timestamp": 20 * i, "input_length": 30 + 5 * (i % 4),
             "output_length": 5 + i % 3, "hash_ids": [i % 2]} for i in range(count)]


def test_kvscope_replay_runs_each_config_and_writes_the_report(
        tmp_path, tiny_chat_model_path, capsys) -> None:
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(8))
    common = ["dtype=float32", "device=cpu", "max_model_len=256"]
    main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--json",
          "--out", str(tmp_path / "out"),
          "--config", "block_size=4", "num_gpu_blocks_override=64", *common,
          "--config", "block_size=16", "num_gpu_blocks_override=16", *common])
    runs = json.loads(capsys.readouterr().out)
    assert [run["config"]["block_size"] for run in runs] == [4, 16]
    for run in runs:
        assert run["mode"] == "live" and run["num_requests"] == 8
        assert run["num_output_tokens"] == sum(r["output_length"] for r in mooncake_rows(8))
        assert {"throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "preemptions",
                "swapped_blocks", "prefix_hit_rate", "peak_kv_usage", "mean_kv_usage",
                "wall_s", "kv_usage"} <= set(run)
        assert 0 < run["peak_kv_usage"] <= 1 and run["kv_usage"]
    assert runs[0]["num_blocks"] == 64 and runs[1]["num_blocks"] == 16
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["report.html", "requests.csv", "runs.csv", "runs.json"]
    report = (tmp_path / "out" / "report.html").read_text()
    assert "block_size=16" in report and "Plotly.newPlot" in report
    assert "<script src" not in report  # plotly.js is inlined: the file opens offline


@pytest.mark.parametrize("knob", ["max_model_len=16", "block_size=3"])
def test_a_failing_replay_writes_no_report(tmp_path, tiny_chat_model_path, knob) -> None:
    """A prompt too long for the config, or a bad knob: the message names it, and the
    runs that did finish leave no half report behind."""
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(3))
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--out",
              str(tmp_path / "out"), "--config", "dtype=float32", "device=cpu",
              "--config", "dtype=float32", "device=cpu", knob])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_simulating_a_trace_with_a_saved_cost_model(tmp_path, tiny_chat_model_path,
                                                    capsys) -> None:
    """(Without one, the replay calibrates its own: tests/test_replay_calibration.py.)"""
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", mooncake_rows(3))
    cost = tmp_path / "cost.json"
    cost.write_text(STEADY_COST.to_json())
    main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--simulate",
          "--cost-model", str(cost), "--json", "--config", "num_gpu_blocks_override=32",
          "--save-cost-model", str(tmp_path / "saved.json")])
    (run,) = json.loads(capsys.readouterr().out)
    assert run["mode"] == "simulated" and run["num_blocks"] == 32
    assert StepCost.from_json((tmp_path / "saved.json").read_text()) == STEADY_COST
    with pytest.raises(SystemExit):  # acceptance needs real tokens: live replays only
        main(["replay", str(trace), "--model", str(tiny_chat_model_path), "--simulate",
              "--cost-model", str(cost), "--config", "num_gpu_blocks_override=32",
              'speculative_config={"method": "ngram"}'])
    assert "speculative_config: a simulated replay" in capsys.readouterr().err


def test_a_simulated_replay_serves_a_traces_priorities_under_the_priority_policy(
        tmp_path, long_context_model) -> None:
    """Six long low-priority requests hold both seats; a short urgent one arrives after
    them. Under fcfs it waits its turn; under priority it is served at once, on one trace."""
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 40, "hash_ids": [i, 100 + i],
             "priority": 1} for i in range(6)]
    rows.append({"timestamp": 500, "input_length": 300, "output_length": 2, "hash_ids": [50],
                 "priority": 0})
    workload = load_trace(write_mooncake(tmp_path / "t.jsonl", rows),
                          load_tokenizer(long_context_model))
    assert [r.priority for r in workload.requests] == [1] * 6 + [0]
    session = ReplaySession(workload, EngineConfig(model=str(long_context_model),
                                                   num_gpu_blocks_override=4096,
                                                   max_num_seqs=2), cost_model=STEADY_COST)

    def urgent_ttft(policy: str) -> float:
        run = session.run({"scheduling_policy": policy}, "simulated")
        return next(t.ttft_s for t in run.requests if t.request_id == "mooncake-7")

    assert urgent_ttft("priority") < STEADY_COST.intercept * 5 < urgent_ttft("fcfs")


def test_kvscope_replay_kv_offload_gb_reports_each_config_with_and_without_the_tier(
        tmp_path, long_context_model, capsys) -> None:
    from kvscope.cli import main

    trace = write_mooncake(tmp_path / "t.jsonl", cycling_prefixes(4))
    cost = tmp_path / "cost.json"
    cost.write_text(STEADY_COST.to_json())
    command = ["replay", str(trace), "--model", str(long_context_model), "--json",
               "--cost-model", str(cost), "--kv-offload-gb", "20", "--config",
               "block_size=16", "num_gpu_blocks_override=100", "max_model_len=1100"]
    with pytest.raises(SystemExit):
        main(command)  # the what-if tier is simulated only
    assert "kv_offload_gb: the what-if tier is simulated" in capsys.readouterr().err
    main([*command, "--simulate"])
    without, with_tier = json.loads(capsys.readouterr().out)
    assert with_tier["label"] == without["label"] + " + 20 GiB disk tier (simulated, 0.3 GB/s)"
    assert with_tier["config"]["kv_offload_gb"] == 20
    assert without["prefix_hit_rate"] == 0 < with_tier["prefix_hit_rate"]
    assert with_tier["ttft_p50_s"] < without["ttft_p50_s"]

