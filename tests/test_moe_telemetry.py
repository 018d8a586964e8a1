"""A mixture-of-experts model's routing in the step records (engine.telemetry.experts):
every step's tokens per expert reconcile with the tokens it ran, with async scheduling's
overlapped forwards too; the bytes read are the chosen experts', each once; a dense
model's records carry none. The same counts reach the session log and its export,
/metrics and the dashboard's Experts panel."""

import asyncio
import base64
import json
import time

import gradio as gr
import numpy as np
import pytest
from conftest import TINY_VOCAB_SIZE
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving.metrics import EngineMetrics
from kvscope.engine.telemetry.experts import recent_counts, step_counts
from kvscope.engine.worker.models.moe import sparse_layers
from kvscope.storage.exports import export_session
from kvscope.storage.reader import load_session
from kvscope.storage.schema import open_database
from kvscope.storage.session_log import SessionLog
from kvscope.ui import build_ui, experts, panels
from kvscope.ui.live import LiveFeeds

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


def test_the_session_log_and_its_export_keep_the_routing(tmp_path, make_engine, run_engine):
    engine = make_engine("qwen3-moe")
    run = run_engine(engine, PROMPTS[:2], PARAMS)
    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session(engine.config.to_dict(), model="tiny-moe")
    for record in run.records:
        log.record_step(record)
    log.close()
    database = open_database(tmp_path / "log.db")
    assert load_session(database, session_id).steps == run.records
    exported = json.loads(export_session(database, session_id, "json", tmp_path).read_text())
    assert [row["expert_tokens"] for row in exported["steps"]] == [
        step_counts(record).tolist() for record in run.records]
    assert exported["steps"][0]["expert_bytes_read"] == run.records[0].expert_bytes_read > 0


def test_metrics_count_what_the_step_records_count(tiny_model):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model("qwen3-moe").path), dtype="float32", device="cpu",
        device_memory_gb=0.05, max_model_len=128)).start()
    try:
        steps = engine.subscribe_steps()
        ids = {list(engine.submit(prompt, PARAMS))[-1].request_id for prompt in PROMPTS[:2]}
        text = asyncio.run(EngineMetrics(engine, "tiny").render()).decode()
        records = []
        deadline = time.monotonic() + 10
        while ids - {request for record in records for request in record.finished}:
            assert time.monotonic() < deadline, "the last step's record never came"
            records += steps.drain()  # a step's record follows its outputs
            time.sleep(0.01)
    finally:
        engine.shutdown()
    layers, counts, _ = recent_counts(records, steps=len(records))
    samples = {(sample.labels.get("layer"), sample.labels.get("expert"), sample.name): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name.startswith("kvscope:moe_")}
    assert {(layer, expert): samples[str(layer), str(expert), "kvscope:moe_expert_tokens_total"]
            for layer in layers for expert in range(counts.shape[1])} == {
        (layer, expert): counts[row, expert] for row, layer in enumerate(layers)
        for expert in range(counts.shape[1])}
    assert samples[None, None, "kvscope:moe_expert_bytes_read_total"] == sum(
        record.expert_bytes_read for record in records) > 0
    assert samples[None, None, "kvscope:moe_expert_bytes_all_total"] == sum(
        record.expert_bytes_all for record in records)


def _typed(spec: dict) -> np.ndarray:
    shape = tuple(int(n) for n in spec["shape"].split(","))
    return np.frombuffer(base64.b64decode(spec["bdata"]), dtype=spec["dtype"]).reshape(shape)


def test_the_experts_panel_draws_a_real_runs_routing(tiny_model):
    """The live renderer's Experts figure: its heatmap is the recent steps' counts summed
    (layers x experts), its lines each step's bytes read and the dense model's; the panel is
    on the page only for a MoE model."""
    config = tiny_model("qwen3-moe").hf_model.config
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model("qwen3-moe").path), dtype="float32", device="cpu",
        device_memory_gb=0.05, max_model_len=128)).start()
    try:
        feeds = LiveFeeds(engine)
        feeds.get(0)  # subscribed to the steps from here on
        renderer = panels.PanelRenderer(feeds)
        for prompt in PROMPTS[:2]:
            list(engine.submit(prompt, PARAMS))
        engine.snapshot()  # its answer follows the last step's records
        *values, _ = renderer.refresh(None)
        records = feeds.get(0).refresh().records
        assert any(_experts_shown(block) for block in build_ui(engine).blocks.values())
    finally:
        engine.shutdown()
    figure = json.loads(values[panels.PANELS.index("experts")].plot)
    heatmap, read, dense = figure["data"]
    layers, counts, summed = recent_counts(records)
    assert summed == sum(1 for record in records if record.expert_tokens) > 2
    assert np.array_equal(_typed(heatmap["z"]), counts)
    assert heatmap["y"] == [f"layer {layer}" for layer in layers]
    assert len(heatmap["x"]) == config.num_experts
    assert read["y"] == [r.expert_bytes_read / experts.MIB for r in records if r.expert_tokens]
    assert dense["y"][0] == records[-1].expert_bytes_all / experts.MIB > read["y"][-1]
    assert "Experts: tokens each expert took over the last" in figure["layout"]["title"]["text"]


def _experts_shown(block) -> bool:
    """An Experts panel shown on the page."""
    return isinstance(block, gr.Plot) and block.elem_id == "kv-experts" and block.visible


def test_a_dense_models_page_hides_the_experts_panel(tiny_chat_model_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu",
        device_memory_gb=0.02, max_model_len=128)).start()
    try:
        assert engine.expert_layout is None
        plots = [block for block in build_ui(engine).blocks.values()
                 if isinstance(block, gr.Plot) and block.elem_id == "kv-experts"]
        assert len(plots) == 1 and not _experts_shown(plots[0])
    finally:
        engine.shutdown()
