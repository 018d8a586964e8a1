"""The dashboard's Compare tab: its handler through gradio_client, and in headless Chromium."""

import os
import re
from pathlib import Path

import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, free_port
from gradio_client import Client
from test_dashboard import open_page

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.storage import SessionLog, record_sessions
from kvscope.ui import build_ui, page_options
from kvscope.ui.compare import KNOBS, MAX_CONFIGS, TABLE_COLUMNS

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def served(tiny_chat_model_path, tmp_path_factory):
    """A served tiny engine whose session already logged a few requests and their steps."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256, max_num_batched_tokens=64,
    )).start()
    log = SessionLog(tmp_path_factory.mktemp("db") / "kvscope.db")
    log.start_session(engine.config.to_dict(), engine.model_path)
    stop_recording = record_sessions(engine, log, poll_s=0.05)
    streams = [engine.submit(f"You are helpful. Question {i}: why?",
                             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
               for i in range(6)]
    for stream in streams:
        list(stream)
    blocks = build_ui(engine, log)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True, **page_options())
    yield engine, log, f"http://127.0.0.1:{port}/"
    blocks.close()
    stop_recording()
    log.close()
    engine.shutdown()


def config_rows(*rows: dict) -> list:
    """The widgets' values for each of the four config rows (unlisted rows disabled)."""
    defaults = {"block_size": 4, "gpu_memory_utilization": 0.9,
                "num_gpu_blocks_override": NUM_BLOCKS, "max_num_seqs": 128,
                "max_num_batched_tokens": 64, "enable_prefix_caching": True,
                "enable_chunked_prefill": True, "preemption_mode": "recompute"}
    values = []
    for index in range(MAX_CONFIGS):
        row = {**defaults, **(rows[index] if index < len(rows) else {})}
        values += [index < len(rows), *(row[k] for k in KNOBS)]
    return values


def test_compare_runs_simulated_configs_on_a_recorded_session(served, tmp_path) -> None:
    engine, log, url = served
    client = Client(url, verbose=False)
    status, table, usage, latency, bars, report = client.predict(
        "recorded session", log.session_id, None, "simulated", 1.0,
        *config_rows({}, {"block_size": 8, "num_gpu_blocks_override": 32}),
        api_name="/compare_runs")
    assert status.startswith("2 simulated runs of 6 requests")
    rows = table["data"]
    assert [row[0] for row in rows] == [
        "1: base config (simulated)", "2: block_size=8, num_gpu_blocks_override=32 (simulated)"]
    peak = TABLE_COLUMNS.index("peak_kv_usage")
    assert 0 < rows[0][peak] < rows[1][peak]  # the same tokens on a third of the pool
    assert "Plotly.newPlot" in Path(report).read_text()
    # The dashboard's engine kept its config, and still serves.
    assert engine.config.block_size == 4 and engine.memory_plan.num_blocks == NUM_BLOCKS
    assert list(engine.submit("still here", SamplingParams(max_tokens=2)))[-1].finished


def test_compare_refuses_one_config_or_no_source(served) -> None:
    client = Client(served[2], verbose=False)
    status, *_ = client.predict("recorded session", served[1].session_id, None, "simulated",
                                1.0, *config_rows({}), api_name="/compare_runs")
    assert "enable 2 to 4 runs (got 1)" in status
    status, *_ = client.predict("uploaded trace", None, None, "simulated", 1.0,
                                *config_rows({}, {}), api_name="/compare_runs")
    assert "upload a trace file first" in status
    status, *_ = client.predict("recorded session", "my session", None, "simulated", 1.0,
                                *config_rows({}, {}), api_name="/compare_runs")
    assert "session: pick a recorded session from the list (got 'my session'" in status


@pytest.mark.browser
def test_browser_compare_tab_runs_and_downloads_its_report(served, tmp_path) -> None:
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed")
    from playwright.sync_api import expect, sync_playwright

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {100 * i}, "input_length": {40 + i}, "output_length": 6, '
        f'"hash_ids": [{i % 2}]}}\n' for i in range(8)))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = open_page(browser, served[2])
        page.get_by_role("tab", name="Compare").click()
        # Opening the tab lists the recorded sessions and picks the newest.
        expect(page.locator("#kv-compare-session input")).to_have_value(re.compile(
            rf"^session {served[1].session_id} \(this one\): \d+ requests, started \d{{4}}-"),
            timeout=10_000)
        page.get_by_label("uploaded trace").check()
        page.locator("#kv-compare-trace input[type=file]").set_input_files(str(trace))
        page.locator("#kv-compare-run").click()
        expect(page.locator("#kv-compare-status")).to_contain_text(
            "2 simulated runs of 8 requests", timeout=60_000)
        expect(page.locator("#kv-compare-usage .js-plotly-plot")).to_be_visible()
        expect(page.locator("#kv-compare-latency .js-plotly-plot")).to_be_visible()
        link = page.locator("#kv-compare-report a").first
        expect(link).to_be_visible(timeout=15_000)
        with page.expect_download() as download_info:
            link.click()
        saved = tmp_path / "report.html"
        download_info.value.save_as(saved)
        page.screenshot(path=tmp_path / "compare.png", full_page=True)
        browser.close()
    assert "Plotly.newPlot" in saved.read_text() and "trace.jsonl" in saved.read_text()


def test_an_emptied_config_field_is_refused_naming_its_run_and_knob() -> None:
    from kvscope.ui.compare import config_changes

    base = EngineConfig(model="m")
    row = (True, 4, 0.9, 0, 8, 64, True, True, "recompute")
    with pytest.raises(ValueError, match="run 2 max_num_seqs is empty: enter a whole number"):
        config_changes(base, (*row, *row[:4], None, *row[5:]))
