"""The dashboard served for real: gradio_client against its handlers, and headless Chromium."""

import itertools
import json
import re
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import dashboard_served, free_port, heatmap_state_codes, wait_until
from gradio_client import Client

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.storage.recorder import POLL_S
from kvscope.ui import build_ui, page_options

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def served(tiny_chat_model_path, tmp_path_factory):
    """A started AsyncEngine on the tiny model, logged to SQLite, with the dashboard up."""
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256, max_num_batched_tokens=64,
    )).start()
    with dashboard_served(engine, tmp_path_factory.mktemp("db") / "kvscope.db") as (log, url):
        yield engine, log, url
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> Client:
    return Client(served[2], verbose=False)


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1100}, accept_downloads=True)
    page.goto(url)
    return page


class KeptRunning:
    """A request submitted again, under the same id, each time it finishes, until the block
    ends: a test that polls for a request's live state then cannot miss it on a fast or a
    loaded machine (a tiny model's 150 tokens can finish between two polls)."""

    def __init__(self, engine, prompt: str, params: SamplingParams,
                 request_id: str | None = None) -> None:
        import threading

        self.runs = 0
        self._stop = threading.Event()
        self._stream = None

        def keep() -> None:
            while not self._stop.is_set():
                self._stream = engine.submit(prompt, params, request_id=request_id)
                list(self._stream)
                self.runs += 1
        self._thread = threading.Thread(target=keep, daemon=True)

    def __enter__(self) -> "KeptRunning":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.abort()
        self._thread.join(timeout=30)


class Ticks:
    """The live poller's refreshes of a page (ui/live_poller.js): it sends one a second,
    each only once the one before it has been answered and drawn."""

    def __init__(self, page) -> None:
        self.page = page
        self.sent = 0
        page.on("request", self._count)

    def _count(self, request) -> None:
        if request.url.endswith("/gradio_api/run/refresh_live"):
            self.sent += 1

    def wait(self, count: int) -> None:
        """Until `count` more refreshes are sent: all but the last of them are drawn."""
        target = self.sent + count
        while self.sent < target:
            self.page.wait_for_event("request", timeout=20_000)

    def wait_for_first_drawing(self) -> None:
        """The page's first drawing of every panel, and the poller's first tick, are in."""
        self.wait(2)


# First in the module: the engine has run nothing yet.
def test_browser_empty_state_says_so_instead_of_drawing_empty_axes(served, browser) -> None:
    from playwright.sync_api import expect

    page = open_page(browser, served[2])
    for text in ("No requests in this window yet", "No engine steps in this window yet",
                 "No sequence holds blocks right now", "No live sequences"):
        expect(page.get_by_text(text)).to_be_visible(timeout=20_000)
    expect(page.get_by_text("paged 100%")).to_have_count(0)
    page.close()


def heatmap_cells(client: Client) -> tuple[list, dict]:
    """The live handler's heatmap as Plotly JSON: its cells' state codes and the figure."""
    panels = client.predict(api_name="/refresh_live")
    figure = json.loads(panels[1]["plot"])
    codes = heatmap_state_codes(figure).ravel()
    return [int(code) for code in codes if not np.isnan(code)], figure


def test_chat_streams_a_reply_with_its_stats(client: Client) -> None:
    job = client.submit("Hello there", 0.0, 1.0, 12, api_name="/chat")
    updates = list(job)
    chatbot, textbox, status = job.result()
    assert len(updates) > 2  # streamed: several partial replies before the last
    assert [message["role"] for message in chatbot] == ["user", "assistant"]
    reply = chatbot[1]["content"][0]["text"]
    assert "TTFT" in reply and "prompt tokens" in reply and "cached" in reply
    # What the person waited for the first text, next to the engine's own TTFT.
    assert "first text after" in reply and "engine TTFT" in reply
    assert textbox == {"__type__": "update"}  # the box is left to the person
    assert "12 output tokens" in status


def test_browser_a_draft_typed_during_a_reply_survives_and_is_sent_after_it(served,
                                                                          browser) -> None:
    """The reply streams without touching the message box; Enter during the reply queues
    the draft, which goes (and gets its own reply) once the first reply ends."""
    import threading

    from playwright.sync_api import expect

    engine = served[0]
    stop = threading.Event()
    streams = []

    def keep_busy() -> None:  # the tiny model replies in a blink on an idle engine; on a
        # full pool the reply takes turns with others for blocks, and streams for seconds
        while not stop.wait(0.02):
            streams.append(engine.submit("busy " * 20,
                                         SamplingParams(max_tokens=150, ignore_eos=True)))

    def end_busy() -> None:  # the backlog goes too: on a slow machine it would keep the
        # draft queued behind it for minutes
        stop.set()
        busy.join()
        for stream in streams:
            stream.abort()
    busy = threading.Thread(target=keep_busy, daemon=True)
    busy.start()
    page = open_page(browser, served[2])
    try:
        # Greedy: the tiny model's reply runs to its length limit (a sampled one can draw
        # EOS within a few tokens and end before the draft is typed).
        temperature = page.locator("#kv-temperature input[type=number]")
        for _ in range(5):  # a click before the page is live does not open the accordion
            if temperature.is_visible():
                break
            page.locator("#kv-chat-sampling").click()
            page.wait_for_timeout(1000)
        temperature.fill("0")
        temperature.press("Enter")
        box = page.locator("#kv-message textarea")
        box.fill("first message")
        box.press("Enter")
        expect(page.locator("#kv-chat-status")).to_contain_text("waits in the box",
                                                                timeout=30_000)
        box.fill("my second thought")
        page.wait_for_timeout(500)  # tokens stream meanwhile
        expect(box).to_have_value("my second thought")
        status = page.locator("#kv-chat-status")
        assert "output tokens" not in status.inner_text()  # the reply is still streaming
        box.press("Enter")  # during the reply: queued, not dropped
        page.wait_for_timeout(300)
        assert "output tokens" not in status.inner_text()  # still the first reply
        end_busy()
        chat = page.locator("#kv-chat")
        expect(chat).to_contain_text("my second thought", timeout=60_000)
        expect(page.locator("#kv-chat .message-row")).to_have_count(4, timeout=60_000)
        expect(page.locator("#kv-chat-status")).to_contain_text("output tokens",
                                                                timeout=60_000)
    finally:
        end_busy()
        page.close()


def test_bad_chat_input_is_a_message_not_a_crash(client: Client) -> None:
    _, textbox, status = client.predict("   ", 0.0, 1.0, 8, api_name="/chat")
    assert status == "Type a message first." and textbox == "   "
    _, _, status = client.predict("x" * 400, 0.0, 1.0, 8, api_name="/chat")
    assert "max_model_len=256" in status
    _, _, status = client.predict("still fine?", 0.0, 1.0, 4, api_name="/chat")
    assert "4 output tokens" in status


@pytest.mark.parametrize("sampling, refusal", [
    ((5.0, 1.0, 8), "temperature=5 is out of range: enter a number from 0 to 2"),
    ((0.0, 1.0, 4096), "max tokens=4096 is out of range: enter a whole number from 1 to 1024"),
    ((0.0, 1.0, 8, 1.0, -0.5), "min-p=-0.5 is out of range: enter a number from 0 to 1"),
])
def test_a_sampling_value_out_of_range_is_refused_naming_the_field_and_its_limits(
        client, sampling, refusal) -> None:
    _, textbox, status = client.predict("Hello", *sampling, api_name="/chat")
    assert status == f"Refused: {refusal}" and textbox == "Hello"


def test_live_heatmap_has_a_cell_per_block_in_the_engines_states(served, client) -> None:
    engine = served[0]
    client.predict("Share this prefix please", 0.0, 1.0, 4, api_name="/chat")
    cells, _ = heatmap_cells(client)
    snapshot = engine.snapshot()
    assert len(cells) == NUM_BLOCKS == snapshot.num_blocks
    codes = {"free": 0, "cached": 1, "used": 2}
    assert [min(v, 3) for v in cells] == [codes.get(b.state, 3) for b in snapshot.blocks]
    assert 1 in cells  # the finished chats left cached prefix blocks


def test_reconfigure_through_the_ui_changes_the_pool(served, client) -> None:
    engine = served[0]
    status = client.predict(8, 0.9, 2.0, -5, True, True, "recompute", "auto", "", 4.0, False,
                            api_name="/apply_knobs")
    assert "Not applied" in status and "max_num_batched_tokens=-5" in status
    assert engine.config.block_size == 4
    status = client.predict(8, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False,
                            api_name="/apply_knobs")
    assert "x 8 tokens" in status and engine.config.block_size == 8
    _, figure = heatmap_cells(client)
    assert "x 8 tokens" in figure["layout"]["title"]["text"]
    status = client.predict(8, 0.9, 2.0, 64, True, True, "recompute", "int8", "", 4.0, False,
                            api_name="/apply_knobs")
    plan = engine.memory_plan
    assert engine.config.kv_cache_dtype == "int8"
    assert plan.bytes_per_block < plan.auto_bytes_per_block
    assert f"kv_cache_dtype int8, {plan.bytes_per_block} bytes/block" in status
    client.predict(4, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False,
                   api_name="/apply_knobs")


def test_a_zero_token_budget_is_refused_naming_the_limit(served, client) -> None:
    status = client.predict(4, 0.9, 2.0, 0, True, True, "recompute", "auto", "", 4.0, False,
                            api_name="/apply_knobs")
    assert "Not applied" in status and "max_num_batched_tokens=0 must be an integer >= 1" \
        in status
    assert served[0].config.max_num_batched_tokens == 64


@pytest.mark.parametrize("count, shared, refusal", [
    (None, 0.5, "requests is empty: enter a whole number"),
    (1e308, 0.5, "requests=1e+308 must be between 1 and 1000"),
    (4, 1.5, "shared system prompt fraction=1.5 is out of range: enter a number from 0 to 1"),
])
def test_a_load_form_value_is_refused_naming_its_field(client, count, shared, refusal) -> None:
    status = client.predict(count, 8.0, shared, 4, 8, 2, 4, 1, api_name="/start_load")
    assert status.startswith(f"**Load not sent:** {refusal}")


def test_an_emptied_or_unbounded_knob_is_refused_naming_it(served, client) -> None:
    status = client.predict(4, 0.9, None, 64, True, True, "recompute", "auto", "", 4.0, False,
                            api_name="/apply_knobs")
    assert "Not applied" in status and "device_memory_gb is empty: enter a number" in status
    status = client.predict(4, 0.9, 1e308, 64, True, True, "recompute", "auto", "", 4.0, False,
                            api_name="/apply_knobs")
    assert "device_memory_gb=1e+308 is more than this machine's RAM" in status
    assert served[0].config.device_memory_gb == 2.0


def test_a_bad_input_tour_logs_no_traceback(served, client, capfd) -> None:
    """Ordinary bad input in every form is answered with a message naming the field, and
    the server's console stays free of tracebacks (they read as crashes)."""
    from gradio_client.exceptions import AppError

    knobs = (4, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False)
    compare_row = (True, 4, 0.9, None, 8, 64, True, True, "recompute")
    tour = [
        ("/apply_knobs", (4, 0.9, 9999, *knobs[3:])),
        ("/apply_knobs", (4, 0.9, None, *knobs[3:])),
        ("/apply_knobs", (4, 5.0, 2.0, *knobs[3:])),
        ("/apply_knobs", (4, 0.9, 2.0, 1e308, *knobs[4:])),
        ("/what_if", (4, 0.9, 9999)),
        ("/start_load", (None, 8.0, 0.5, 4, 8, 2, 4, 1)),
        ("/start_load", (1e308, 8.0, 0.5, 4, 8, 2, 4, 1)),
        ("/start_load", (4, 8.0, 0.5, 900, 900, 2, 4, 1)),
        ("/start_load", (4, 8.0, 1.5, 4, 8, 2, 4, 1)),
        ("/chat", ("Hello", 5.0, 1.0, 8)),
        ("/check_view_fields", (99999999999, -1, 0, 0)),
        ("/check_frame", ("banana", 0)),
        ("/refresh_live", (None, None, "whole pool", 0, 0, "most recent", 1, "", 0, "",
                           "banana")),
        ("/step_back", (0, "banana")),
        ("/session_frame", (served[1].session_id, "banana")),
        ("/session_frame", ("nope", "")),
        ("/export_session", ("nope", "json")),
        ("/compare_runs", ("recorded session", None, None, "simulated", 1.0,
                           *compare_row, *compare_row, *(False, *compare_row[1:]) * 2)),
        ("/compare_runs", ("recorded session", served[1].session_id, None, "simulated", 1.0,
                           *compare_row[:4], None, *compare_row[5:], *compare_row,
                           *(False, *compare_row[1:]) * 2)),
    ]
    client.predict(api_name="/refresh_live")  # the tab's feed records frames from here
    list(served[0].submit("frames to step through", SamplingParams(max_tokens=2)))
    wait_until(lambda: client.predict(0, api_name="/pause")[0] != "",
               what="a recorded frame")
    served[1].flush(timeout=5.0)  # the session's frames too
    capfd.readouterr()
    for api_name, args in tour:
        try:
            client.predict(*args, api_name=api_name)
        except AppError:
            pass  # refused with a message, as the page shows it
    logged = "".join(capfd.readouterr())
    assert "Traceback" not in logged, logged[-3000:]
    assert served[0].config.device_memory_gb == 2.0


def test_browser_new_tab_loads_the_live_knobs_after_apply(served, client, browser) -> None:
    from playwright.sync_api import expect

    engine = served[0]
    client.predict(8, 0.9, 2.0, 32, True, True, "recompute", "auto", "", 4.0, False,
                   api_name="/apply_knobs")
    try:
        page = open_page(browser, served[2])  # opened after the Apply, from another client
        page.get_by_role("tab", name="Engine & load").click()
        expect(page.locator("#kv-budget input")).to_have_value("32", timeout=15_000)
        expect(page.locator("#kv-block-size input")).to_have_value("8")
        expect(page.locator("#kv-knob-status")).to_contain_text(
            f"{engine.memory_plan.num_blocks} blocks x 8 tokens")
        page.close()
    finally:
        client.predict(4, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False,
                       api_name="/apply_knobs")
    assert engine.config.block_size == 4


def test_browser_the_what_if_preview_follows_the_live_sequences_while_its_tab_is_shown(
        served, browser) -> None:
    """The preview under the knobs counts the sequences live now, not those live when the
    page loaded: a request that starts, and then ends, while the tab is shown."""
    from playwright.sync_api import expect

    engine = served[0]
    page = open_page(browser, served[2])
    try:
        # A tab clicked before the page's events are connected would not start its timer.
        page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=60_000)
        page.get_by_role("tab", name="Engine & load").click()
        what_if = page.locator("#kv-what-if")
        expect(what_if).to_contain_text("No live sequences now", timeout=30_000)
        params = SamplingParams(max_tokens=150, ignore_eos=True)
        with KeptRunning(engine, "still running " * 8, params, request_id="what-if-live"):
            expect(what_if).to_contain_text("The one live sequence would hold",
                                            timeout=30_000)
        expect(what_if).to_contain_text("No live sequences now", timeout=30_000)
    finally:
        page.close()


def test_browser_a_device_memory_the_form_refuses_is_never_applied(served, browser,
                                                                    capfd) -> None:
    """9999 GiB typed into device_memory_gb and Apply pressed: refused in the field's own
    terms (this machine's RAM), with no traceback in the server's console, and neither
    then nor seconds later is the engine rebuilt at another value (a slider clamped it to
    its maximum and applied that)."""
    from playwright.sync_api import expect

    engine = served[0]
    before = engine.config.device_memory_gb
    page = open_page(browser, served[2])
    try:
        page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=60_000)
        page.get_by_role("tab", name="Engine & load").click()
        field = page.locator("#kv-device-memory input[type=number]")
        field.fill("9999")
        field.press("Tab")
        page.locator("#kv-apply").click()
        status = page.locator("#kv-knob-status")
        expect(status).to_contain_text("Not applied", timeout=30_000)
        expect(status).to_contain_text("device_memory_gb=9999 is more than this machine's RAM")
        expect(page.locator("#kv-what-if")).to_contain_text("Apply would be refused")
        page.wait_for_timeout(3_000)  # what the page sends after the refusal, if anything
        expect(status).not_to_contain_text("Applied")
        assert engine.config.device_memory_gb == before
    finally:
        page.close()
    assert "Traceback" not in "".join(capfd.readouterr())


def test_every_plot_has_its_label_above_the_chart_not_over_its_title(served) -> None:
    """Gradio draws a plot's label over the figure's top left corner, where the figures put
    their titles ("403 blocks" for 4403): every tab's plots carry the class that moves it."""
    import gradio as gr

    from kvscope.ui.plotdata import PANEL_CLASS

    plots = [block for block in build_ui(served[0], served[1]).blocks.values()
             if isinstance(block, gr.Plot)]
    assert len(plots) > 10
    assert [plot.label for plot in plots if PANEL_CLASS not in (plot.elem_classes or [])] == []


@pytest.mark.parametrize("tab", ["Live", "Compare"])
def test_browser_no_text_of_a_tab_is_clipped_at_1280_px(served, browser, tab: str) -> None:
    """bench/clipped_text.py reads every tab at two sizes and under load; here the Live
    tab and the Compare tab's run cards ("ru 1", "pr ca" once) at the narrow one."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from clipped_text import CLIPPED_TEXT_JS

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(served[2])
        Ticks(page).wait_for_first_drawing()
        if tab != "Live":
            page.get_by_role("tab", name=tab).click()
            page.locator("#kv-compare-run").wait_for()
        clipped = page.evaluate(CLIPPED_TEXT_JS)
        assert clipped == [], json.dumps(clipped, indent=1)
    finally:
        page.close()


def test_browser_trash_icon_starts_a_new_conversation(served, browser) -> None:
    from playwright.sync_api import expect

    page = open_page(browser, served[2])
    chat = page.locator("#kv-chat")
    message = page.locator("#kv-message textarea")
    message.fill("Hello")
    message.press("Enter")
    expect(chat).to_contain_text("output tokens", timeout=30_000)
    first = chat.inner_text()
    prompt_tokens = first[:first.index(" prompt tokens")].rsplit(" ", 1)[-1]
    chat.get_by_label("Clear").click()
    expect(chat).not_to_contain_text("output tokens")
    message.fill("Hello")
    message.press("Enter")
    expect(chat).to_contain_text("output tokens", timeout=30_000)
    # The same one-message prompt again, not the first exchange plus this message.
    expect(chat).to_contain_text(f"{prompt_tokens} prompt tokens")
    page.close()


def test_browser_panels_out_of_view_wait_until_scrolled_into_view(served, browser) -> None:
    """A tab refreshes only the panels on screen (ui/live_poller.js): one
    scrolled out of view keeps its last drawing, and is drawn anew once it comes into
    view, while the panels on screen stay live meanwhile."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 700})
    ticks = Ticks(page)
    page.goto(served[2])
    timeline = page.locator("#kv-timeline .js-plotly-plot")
    timeline.wait_for(state="attached", timeout=20_000)
    drawn = "el => JSON.stringify([el.data, el.layout.title])"
    assert page.evaluate("document.getElementById('kv-timeline').getBoundingClientRect().top"
                         " > window.innerHeight")
    ticks.wait_for_first_drawing()
    before, stats = timeline.evaluate(drawn), page.locator("#kv-stats").inner_text()
    engine = served[0]
    list(engine.submit("out of view", SamplingParams(max_tokens=6, ignore_eos=True)))
    expect(page.locator("#kv-stats")).not_to_have_text(stats, timeout=15_000)  # on screen
    ticks.wait(3)  # two more ticks answered
    assert timeline.evaluate(drawn) == before  # out of view: not redrawn
    timeline.scroll_into_view_if_needed()
    page.wait_for_function(
        "before => JSON.stringify([document.querySelector('#kv-timeline .js-plotly-plot')"
        ".data, document.querySelector('#kv-timeline .js-plotly-plot').layout.title])"
        " !== before", arg=before, timeout=15_000)
    page.close()


def test_browser_live_tab_polls_once_a_second_and_redraws_only_what_changed(served,
                                                                           browser) -> None:
    """ui/live_poller.js: an open Live tab makes one unqueued POST a second and no Gradio
    queue event; an idle engine redraws no figure; a request redraws the heatmap."""
    from playwright.sync_api import expect

    page = open_page(browser, served[2])
    page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=20_000)
    Ticks(page).wait_for_first_drawing()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.evaluate("""() => {
      window.redraws = {};
      for (const div of document.querySelectorAll('.js-plotly-plot')) {
        const id = div.closest('[id^="kv-"]').id;
        window.redraws[id] = 0;
        div.on('plotly_afterplot', () => { window.redraws[id] += 1; });
      }
    }""")
    page.wait_for_timeout(3500)  # the window the poll rate is counted over
    polls = [url for url in requests if url.endswith("/gradio_api/run/refresh_live")]
    assert 2 <= len(polls) <= 5
    assert not [url for url in requests if "/queue/" in url]  # no Gradio event round trip
    assert sum(page.evaluate("window.redraws").values()) == 0  # nothing changed: no redraw
    stats = page.locator("#kv-stats").inner_text()
    list(served[0].submit("poll me", SamplingParams(max_tokens=6, ignore_eos=True)))
    expect(page.locator("#kv-stats")).not_to_have_text(stats, timeout=15_000)
    page.wait_for_function("window.redraws['kv-heatmap'] > 0", timeout=15_000)
    page.close()


def test_browser_a_figure_slow_to_draw_is_asked_for_less_often(served, browser) -> None:
    """ui/live_poller.js keeps each figure's drawing under a share of a core: after a
    heatmap that took 300 ms to draw, the next ticks leave it out (the server neither
    builds nor sends it) while the cheap panels stay live."""
    page = open_page(browser, served[2])
    ticks = Ticks(page)
    page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=20_000)
    ticks.wait_for_first_drawing()
    page.evaluate("""() => {
      window.slowDraws = 0;
      const react = window.Plotly.react;
      window.Plotly.react = function (div, ...rest) {
        if (div.closest('#kv-heatmap')) {
          const until = performance.now() + 300;
          while (performance.now() < until) {}
          window.slowDraws += 1;
        }
        return react.call(this, div, ...rest);
      };
    }""")
    list(served[0].submit("draw me slowly", SamplingParams(max_tokens=6, ignore_eos=True)))
    page.wait_for_function("window.slowDraws > 0", timeout=15_000)
    asked: list[list[str]] = []
    page.on("request", lambda request: asked.append(json.loads(request.post_data)["data"][1])
            if request.url.endswith("/gradio_api/run/refresh_live") else None)
    ticks.wait(3)
    assert len(asked) >= 2
    assert all("stats" in panels and "heatmap" not in panels for panels in asked)
    page.close()

def test_browser_idle_page_draws_no_frames(served, browser) -> None:
    """An idle, loaded page asks for no animation frames. Gradio's loading screen leaves a
    status tracker's requestAnimationFrame loop running at 60 frames a second on every
    page (ui/frame_guard.js ends it); any loop like it fails this test."""
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    # Runs before the page's own scripts: counts every animation-frame callback it runs.
    context.add_init_script("""
      window.framesRun = 0;
      const request = window.requestAnimationFrame.bind(window);
      window.requestAnimationFrame = (callback) =>
        request((time) => { window.framesRun += 1; callback(time); });
    """)
    page = context.new_page()
    ticks = Ticks(page)
    page.goto(served[2])
    page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=20_000)
    ticks.wait_for_first_drawing()
    # The removed loading spinner's last spring animation (~3 s) is over once half a second
    # passes without a frame; a leaked loop never gets there.
    page.wait_for_function("""() => {
      const quiet = window.framesRun === window.framesSeen;
      window.framesSeen = window.framesRun;
      return quiet;
    }""", polling=500, timeout=20_000)
    before = page.evaluate("window.framesRun")
    assert before > 0  # the counter sees the page's frames (the first drawing asked some)
    ticks.wait(3)  # three of the poller's ticks, the engine idle
    assert page.evaluate("window.framesRun") - before <= 5  # a leaked loop runs ~180
    context.close()


def test_sessions_list_and_export(served, client, tmp_path: Path) -> None:
    log = served[1]
    table, _, _ = client.predict(api_name="/list_sessions")
    assert table["data"][0][0] == log.session_id
    path, status = client.predict(log.session_id, "sqlite", api_name="/export_session")
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT count(*) FROM steps").fetchone()[0] > 0
    path, status = client.predict(log.session_id, "csv", api_name="/export_session")
    assert path.endswith(".zip") and "a .zip holding one CSV file per table" in status
    path, status = client.predict(999, "json", api_name="/export_session")
    assert path is None and "session_id=999: no such session" in status
    *_, config = client.predict(log.session_id, api_name="/show_session")
    # The earlier tests' reconfigures, each kept with its time, after the start's config.
    sizes = [entry["block_size"] for entry in config["history"]]
    assert sizes[0] == 4 and 8 in sizes and config["latest"]["block_size"] == sizes[-1] == 4
    assert all(entry["applied_at"] for entry in config["history"])
    # What ran, not what the config said ("auto", None): the resolved device and dtype.
    assert config["latest"]["device"] == "cpu" and config["latest"]["model"] == \
        served[0].resolved_identity()["model"]


def test_browser_the_sessions_tab_lists_the_counts_of_now_each_time_it_is_shown(
        served, browser) -> None:
    """A Sessions tab opened once and shown again lists the requests run since, and draws
    them in the session's timeline, without a click on Refresh."""
    from playwright.sync_api import expect

    engine, log = served[0], served[1]
    page = open_page(browser, served[2])
    try:
        page.locator("#kv-heatmap .js-plotly-plot").wait_for(timeout=60_000)  # connected
        page.get_by_role("tab", name="Sessions").click()
        # The current session's row (the newest, listed first), its "finished requests" column.
        requests_cell = page.locator("#kv-sessions-table tbody tr").first.locator("td").nth(4)

        def listed() -> int:
            return int(requests_cell.text_content().strip() or -1)
        wait_until(lambda: listed() >= 0, timeout=30, what="the sessions table")
        before = listed()
        page.get_by_role("tab", name="Live").click()
        list(engine.submit("one more request", SamplingParams(max_tokens=4),
                           request_id="shown-again"))
        wait_until(lambda: log.list_sessions()[0]["num_requests"] > before, timeout=30)
        page.get_by_role("tab", name="Sessions").click()
        wait_until(lambda: listed() > before, timeout=30, what="the sessions table's update")
        expect(page.locator("#kv-session-timeline")).to_contain_text("shown-again",
                                                                     timeout=30_000)
    finally:
        page.close()


def test_browser_chat_heatmap_and_export(served, browser, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    page = open_page(browser, served[2])
    page.locator("#kv-message textarea").fill("Hi from the browser")
    page.locator("#kv-message textarea").press("Enter")
    expect(page.locator("#kv-chat")).to_contain_text("TTFT", timeout=30_000)
    heatmap = page.locator("#kv-heatmap .js-plotly-plot")
    expect(heatmap).to_be_visible(timeout=15_000)
    expect(heatmap.locator(".heatmaplayer image")).to_have_count(1)
    page.screenshot(path=tmp_path / "live.png", full_page=True)

    page.get_by_role("tab", name="Sessions").click()
    expect(page.locator("#kv-sessions-status")).to_contain_text(re.compile(r"sessions? in "))
    page.locator("#kv-export").click()
    link = page.locator("#kv-download a").first
    # The module's session holds every step and pool record the tests before it logged:
    # exporting it on a loaded 2-core machine took over 15 s.
    expect(link).to_be_visible(timeout=60_000)
    with page.expect_download() as download_info:
        link.click()
    saved = tmp_path / download_info.value.suggested_filename
    download_info.value.save_as(saved)
    page.screenshot(path=tmp_path / "sessions.png", full_page=True)
    page.close()
    assert json.loads(saved.read_text())["sessions"][0]["id"] == served[1].session_id
    assert (tmp_path / "live.png").stat().st_size > 0


def test_browser_on_a_100k_block_pool_loads_refreshes_and_zooms(tiny_chat_model_path,
                                                               browser) -> None:
    """GPU scale on the CPU: 100,000 blocks of one token. The heatmap draws aggregate cells,
    a running request shows up at the next refresh, and the used region zooms to blocks."""
    from playwright.sync_api import expect

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=1,
        num_gpu_blocks_override=100_000, max_model_len=256, max_num_batched_tokens=64,
    )).start()
    blocks = build_ui(engine)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True, **page_options())
    try:
        page = open_page(browser, f"http://127.0.0.1:{port}/")
        heatmap = page.locator("#kv-heatmap")
        expect(heatmap).to_contain_text("Block pool: 100000 blocks", timeout=30_000)
        expect(heatmap).to_contain_text("one cell = 25 blocks")
        expect(heatmap).to_contain_text("free 100000 ·")
        stream = engine.submit("a prompt that holds blocks " * 4,
                               SamplingParams(max_tokens=150, ignore_eos=True))
        # The next refresh shows the request's blocks (in use, or cached once it ended).
        expect(heatmap).not_to_contain_text("free 100000 ·", timeout=20_000)
        page.locator("#kv-heatmap-view").get_by_text("used region").click()
        expect(heatmap).to_contain_text("one cell per block", timeout=20_000)
        expect(heatmap.locator(".heatmaplayer image")).to_have_count(1)
        page.close()
        stream.abort()
    finally:
        blocks.close()
        engine.shutdown()


def test_a_negative_view_field_is_refused_at_the_field_and_the_refresh_keeps_running(
        client: Client) -> None:
    panels = client.predict(None, None, "block range", -5, -1, "most recent", 0, "",
                            api_name="/refresh_live")
    assert "Block pool: 96 blocks" in json.loads(panels[1]["plot"])["layout"]["title"]["text"]
    assert client.predict(-5, -1, 0, 0, api_name="/check_view_fields") == (0, 0, 1)


@pytest.mark.parametrize("fields, checked, warning", [
    ((30, 20, 1), (30, 0, 1), "to block=20 refused: it must be more than from block=30"),
    ((99999999999, 0, 1), (0, 0, 1),
     f"from block=1e+11 refused: the pool has {NUM_BLOCKS} blocks"),
])
def test_a_view_field_the_view_cannot_show_is_refused_naming_it_and_its_limit(
        served, fields, checked, warning) -> None:
    """Bad view input is refused with a word, not taken without one: a range that ends
    before it starts, a block past the pool."""
    from kvscope.ui import panels
    from kvscope.ui.live import LiveFeeds

    with pytest.warns(UserWarning, match=re.escape(warning)):
        assert panels.check_view_fields(LiveFeeds(served[0]), *fields) == checked


def test_a_frame_that_is_not_a_number_or_not_kept_is_refused_naming_the_field(served) -> None:
    from kvscope.ui import panels
    from kvscope.ui.live import LiveFeeds

    feeds = LiveFeeds(served[0])
    feed = feeds.get(0)
    feed.refresh()  # the feed records the frames of what runs from here
    with pytest.warns(UserWarning, match="frame shown='banana' refused: enter a frame number"):
        panels.check_frame(feeds, "banana")
    list(served[0].submit("make a frame", SamplingParams(max_tokens=2)))
    wait_until(lambda: feed.refresh() and feed.history.last is not None,
               what="a recorded frame")
    with pytest.warns(UserWarning, match=f"frame shown=99999999999 refused: frames "
                      f"{feed.history.first} to [0-9]+ are kept; showing frame"):
        panels.check_frame(feeds, "99999999999")


def test_the_summary_counts_sequences_and_requests_and_says_why_they_differ(
        served, client: Client) -> None:

    summaries = []

    def two_sequences() -> bool:  # the summary alone (no panel on screen): a quick call
        summaries.append(client.predict(None, [], api_name="/refresh_live")[0])
        return "running</strong> 2 sequences (1 request)" in summaries[-1]
    with KeptRunning(served[0], "two samples", SamplingParams(n=2, max_tokens=150,
                                                             ignore_eos=True)):
        wait_until(two_sequences, timeout=30, what="the n=2 request in the summary")
    assert "blocks in use</strong>" in summaries[-1]
    assert "num_requests_running and num_requests_waiting count requests" in summaries[-1]


def test_a_finished_request_followed_has_its_cached_blocks_outlined(served, client) -> None:
    """A finished chat turn holds no block, but its full blocks stay cached: following it
    outlines them and says so, not "0 blocks outlined"."""
    engine = served[0]
    client.predict(api_name="/refresh_live")  # the tab's feed sees the request come and go
    list(engine.submit("a finished turn keeps its blocks " * 3,
                       SamplingParams(max_tokens=2), request_id="finished-turn"))

    def heatmap() -> dict:
        panels = client.predict(None, None, "whole pool", 0, 0, "most recent", 1, "", 0,
                                "finished-turn", api_name="/refresh_live")
        return json.loads(panels[1]["plot"])
    wait_until(lambda: "(finished)" in heatmap()["layout"]["title"]["text"],
               what="the feed to see the request leave")
    figure = heatmap()
    title = figure["layout"]["title"]["text"]
    cached = int(re.search(r"following finished-turn \(finished\): (\d+) of the (\d+) "
                           r"blocks it held are still cached, \1 outlined", title).group(1))
    outline = [trace for trace in figure["data"] if trace.get("name") == "finished-turn"]
    assert cached >= 1 and len(outline) == 1 and len(outline[0]["x"]) == cached
    codes = heatmap_state_codes(figure).ravel()
    outlined = {int(row) + column for row, column in zip(outline[0]["y"], outline[0]["x"],
                                                         strict=True)}
    assert all(codes[block] == codes[min(outlined)] for block in outlined)  # all cached


def test_a_followed_request_is_outlined_in_the_heatmap_and_first_in_the_tables(
        served, client: Client) -> None:

    engine = served[0]
    request_id = "follow-me"
    followed = KeptRunning(engine, "follow me " * 6,
                           SamplingParams(max_tokens=150, ignore_eos=True), request_id)
    other = KeptRunning(engine, "not me " * 6, SamplingParams(max_tokens=150, ignore_eos=True),
                        "not-me")
    panels: list = []
    views = itertools.cycle(((1, 0), (2, NUM_BLOCKS)))

    def drawn() -> bool:
        """Drawn while both hold blocks. Each call names another view that draws the same
        (table page 2 of 1 is page 1; "to block" 96 is the end): a new view is drawn at
        once, so the heatmap and the tables are of one pool state, the same refresh's."""
        page, stop = next(views)
        panels[:] = client.predict(None, None, "whole pool", 0, stop, "most recent", page,
                                   "", 0, request_id, api_name="/refresh_live")
        tables = json.loads(panels[2]["plot"])["data"]
        return bool(tables) and len(tables[0].get("y") or []) == 2
    with followed, other:
        wait_until(drawn, timeout=30, what="both requests holding blocks")
    heatmap = json.loads(panels[1]["plot"])
    outline = [trace for trace in heatmap["data"] if trace.get("name") == request_id]
    assert len(outline) == 1 and outline[0]["x"]
    outlined = {int(row) + column for row, column in zip(outline[0]["y"], outline[0]["x"],
                                                         strict=True)}
    codes = heatmap_state_codes(heatmap).ravel()  # the same figure: every outlined cell is held
    assert all(codes[block] >= 2 for block in outlined)
    # The request's blocks as its table rows show them (a long table shows its ends).
    tables = drawn_tables(json.loads(panels[2]["plot"]))
    followed_ids = {block for seq_id, blocks in tables.items()
                    if seq_id.split("#")[0] == request_id for block in blocks}
    other_ids = {block for seq_id, blocks in tables.items()
                 if seq_id.split("#")[0] != request_id for block in blocks}
    assert followed_ids <= outlined and not other_ids & outlined
    assert f"following {request_id}" in heatmap["layout"]["title"]["text"]
    tables = json.loads(panels[2]["plot"])["data"][0]
    assert tables["y"][0].startswith(f"▶ {request_id}") and not tables["y"][1].startswith("▶")


def test_browser_a_click_on_a_block_table_row_follows_its_request(served, browser) -> None:
    import re
    import threading

    from playwright.sync_api import expect

    engine = served[0]
    stop = threading.Event()

    def send() -> None:  # one "clicked-N" request after another: one holds blocks mostly
        number = 0
        while not stop.is_set():
            list(engine.submit("click me " * 6, SamplingParams(max_tokens=200, ignore_eos=True),
                               request_id=f"clicked-{number}"))
            number += 1
    sender = threading.Thread(target=send, daemon=True)
    page = open_page(browser, served[2])
    try:
        tables = page.locator("#kv-block-tables")
        tables.scroll_into_view_if_needed()
        page.get_by_label("sequence id contains").fill("clicked")
        sender.start()
        expect(tables).to_contain_text("clicked-", timeout=30_000)
        field = page.locator("#kv-follow textarea, #kv-follow input").first
        for _ in range(5):  # a click as one request ends and the table redraws hits no row
            tables.locator(".nsewdrag").first.click(position={"x": 10, "y": 10})
            try:
                expect(field).to_have_value(re.compile(r"^clicked-\d+$"), timeout=3_000)
                break
            except AssertionError:
                continue
        expect(field).to_have_value(re.compile(r"^clicked-\d+$"), timeout=1_000)
        page.locator("#kv-heatmap").scroll_into_view_if_needed()
        expect(page.locator("#kv-heatmap")).to_contain_text(
            f"following {field.input_value()}", timeout=15_000)
    finally:
        stop.set()
        sender.join()
        page.close()


def test_browser_a_click_on_a_chat_turn_follows_its_request(served, browser) -> None:
    """A click on a reply puts the request the engine ran for it (as the session log
    records it) in the follow field, and the timeline and the heatmap then follow it."""
    from playwright.sync_api import expect

    from kvscope.storage.reader import load_session

    log = served[1]
    page = open_page(browser, served[2])
    try:
        box = page.locator("#kv-message textarea")
        box.fill("which request am I?")
        box.press("Enter")
        expect(page.locator("#kv-chat-status")).to_contain_text("output tokens", timeout=60_000)

        def logged_reply() -> str | None:
            replies = [message for message in load_session(log.engine, log.session_id)
                       .chat_messages if message["role"] == "assistant"
                       and message["request_id"]]
            return replies[-1]["request_id"] if replies else None
        wait_until(logged_reply, timeout=20, what="the reply in the session log")
        request_id = logged_reply()
        page.locator("#kv-chat .message-row").last.click()
        field = page.locator("#kv-follow textarea, #kv-follow input").first
        expect(field).to_have_value(request_id, timeout=10_000)
        for panel in ("#kv-timeline", "#kv-heatmap"):
            page.locator(panel).scroll_into_view_if_needed()
            expect(page.locator(panel)).to_contain_text(f"following {request_id}",
                                                        timeout=15_000)
    finally:
        page.close()


def test_browser_a_click_on_a_timeline_row_follows_its_request(served, browser) -> None:
    from playwright.sync_api import expect

    engine = served[0]
    page = open_page(browser, served[2])
    try:
        Ticks(page).wait_for_first_drawing()  # the tab's feed follows the engine from here
        # Long enough (no early EOS) that its bar is wider than a sliver on a timeline that
        # spans the whole module's traffic.
        list(engine.submit("on the timeline " * 4,
                           SamplingParams(max_tokens=48, ignore_eos=True),
                           request_id="timeline-row"))
        timeline = page.locator("#kv-timeline")
        timeline.scroll_into_view_if_needed()
        expect(timeline).to_contain_text("timeline-row", timeout=30_000)
        # The middle of a bar on the request's row (Plotly keeps each bar's point, whose
        # index gives its row, on the bar's element), asked until a redraw has drawn it.
        box = page.wait_for_function("""(panel) => {
            for (const trace of panel.querySelectorAll(".barlayer .trace")) {
              const rows = trace.__data__[0].trace.y;
              for (const bar of trace.querySelectorAll(".point")) {
                if (!String(rows[bar.__data__.i]).startsWith("timeline-row")
                    || bar.getBoundingClientRect().width <= 2) continue;
                bar.scrollIntoView({block: "center"});  // a tall timeline's row can be
                const box = bar.getBoundingClientRect();  // below the window
                return {x: box.x + box.width / 2, y: box.y + box.height / 2};
              }
            }
            return null;
        }""", arg=timeline.element_handle(), timeout=15_000).json_value()
        page.mouse.click(box["x"], box["y"])
        field = page.locator("#kv-follow textarea, #kv-follow input").first
        expect(field).to_have_value("timeline-row", timeout=10_000)
        expect(timeline).to_contain_text("following timeline-row", timeout=15_000)
    finally:
        page.close()


class PoolReference:
    """The engine's own pool after each delta, from a subscription of the test's own (the
    same records the dashboard reads, applied by a PoolMirror, not by the scrubber): per
    delta index of the newest pool, every block's state code and the block tables."""

    def __init__(self, engine) -> None:
        from kvscope.engine.telemetry.pool_mirror import PoolMirror

        self.engine = engine
        self.channel = engine.subscribe_pool()
        self.mirror = PoolMirror()
        self.epoch = None
        self.codes: dict[int, list[int]] = {}
        self.tables: dict[int, dict[str, tuple[int, ...]]] = {}

    def drain(self) -> int | None:
        """Apply what arrived; the newest delta index recorded (None: none yet)."""
        from kvscope.engine.telemetry.records import PoolDelta

        for record in self.channel.drain():
            assert self.mirror.apply(record), "the reference missed a delta"
            if isinstance(record, PoolDelta) and self.mirror.ready:
                if record.epoch != self.epoch:
                    self.epoch, self.codes, self.tables = record.epoch, {}, {}
                self.codes[record.index] = self.mirror.state_codes().tolist()
                self.tables[record.index] = {seq.seq_id: tuple(seq.block_table)
                                             for seq in self.mirror.sequences if seq.block_table}
        return max(self.codes, default=None)

    def close(self) -> None:
        self.channel.close()


def delta_index(status: str) -> int:
    import re

    return int(re.search(r"pool delta (\d+)", status).group(1))


def drawn_tables(figure: dict) -> dict[str, tuple[int, ...]]:
    """The block-table panel's rows: sequence id -> the physical block ids it shows."""
    trace = figure["data"][0]
    return {label.removeprefix("▶ ").split(" (")[0]: tuple(
        int(str(cell).split("<br>")[0]) for cell in row if cell != "")
        for label, row in zip(trace["y"], trace["text"], strict=True)}


def scrub_back_to_held_blocks(step_back, frame: int, reference: PoolReference) -> tuple:
    """Step back one frame at a time from `frame` until one whose pool (by the
    reference) has a sequence holding blocks, and whose blocks differ from the frame
    before it (so a frame off by one would show); (frame, status)."""
    for _ in range(200):
        frame, status = step_back(str(frame))
        index = delta_index(status)
        if reference.tables.get(index) and index - 1 in reference.codes and (
                reference.codes[index], reference.tables[index]) != (
                reference.codes[index - 1], reference.tables[index - 1]):
            return int(frame), status
    pytest.fail("no frame with blocks held within 200 frames back")


def run_a_request_the_scrubber_can_step_through(engine, reference: PoolReference) -> None:

    list(engine.submit("scrub me " * 6, SamplingParams(max_tokens=24, ignore_eos=True)))
    last = engine.snapshot()  # every delta up to the request's end has been sent
    wait_until(lambda: reference.drain() is not None and not reference.tables[
        max(reference.codes)] and reference.mirror.step >= last.step, timeout=20,
        what="the reference to see the request end")


def test_the_scrubber_pauses_steps_back_and_every_panel_shows_that_recorded_frame(
        served, client: Client) -> None:
    engine = served[0]
    reference = PoolReference(engine)
    try:
        client.predict(api_name="/refresh_live")  # the tab's feed follows the pool from here
        run_a_request_the_scrubber_can_step_through(engine, reference)
        client.predict(api_name="/refresh_live")  # and drains what the request did
        latest, status = client.predict(0, api_name="/pause")
        assert f"Paused at frame {latest}" in status
        frame, status = scrub_back_to_held_blocks(
            lambda frame: client.predict(0, frame, api_name="/step_back"), latest, reference)
        index = delta_index(status)
        panels = client.predict(None, None, "whole pool", 0, 0, "most recent", 1, "", 0, "",
                                str(frame), api_name="/refresh_live")
        heatmap = json.loads(panels[1]["plot"])
        codes = heatmap_state_codes(heatmap).ravel()
        assert [int(code) for code in codes if not np.isnan(code)] == reference.codes[index]
        assert reference.codes[index] != reference.codes[max(reference.codes)]  # not live
        assert drawn_tables(json.loads(panels[2]["plot"])) == reference.tables[index]
        assert f"paused at frame {frame}" in panels[0]
        assert int(client.predict(0, str(frame), api_name="/step_forward")[0]) == frame + 1
        assert client.predict(api_name="/resume")[0] == ""
        assert "paused" not in client.predict(api_name="/refresh_live")[0]
    finally:
        reference.close()


def test_a_saved_sessions_pool_steps_back_to_the_frame_the_engine_recorded(
        served, client: Client) -> None:
    engine, log = served[0], served[1]
    reference = PoolReference(engine)
    try:
        run_a_request_the_scrubber_can_step_through(engine, reference)
        shown = []

        def logged_the_newest() -> bool:  # the recorder writes the pool's records behind it
            shown[:] = client.predict(log.session_id, "", api_name="/session_frame")
            return delta_index(shown[1]) >= max(reference.codes)
        wait_until(logged_the_newest, timeout=30, what="the log to hold the newest frame")
        frame, status = scrub_back_to_held_blocks(
            lambda frame: client.predict(log.session_id, frame,
                                         api_name="/session_frame_back")[:2],
            shown[0], reference)
        shown = client.predict(log.session_id, str(frame), api_name="/session_frame")
        index = delta_index(shown[1])
        codes = heatmap_state_codes(json.loads(shown[3]["plot"])).ravel()
        assert [int(code) for code in codes if not np.isnan(code)] == reference.codes[index]
        assert drawn_tables(json.loads(shown[4]["plot"])) == reference.tables[index]
        assert "blocks in use" in shown[2] and "**Events**" in shown[6]
        # The Sessions tab has no Live button: its status names the way it does have.
        assert "a blank frame field shows the last frame" in shown[1]
        assert "Live" not in shown[1]
    finally:
        reference.close()


def test_a_reconfigure_is_logged_once(served, client: Client) -> None:
    """Apply logs nothing itself: the session recorder notices the new config and logs it,
    once (the knobs handler and the recorder both used to report it)."""

    log = served[1]

    def configs() -> list[dict]:
        log.flush()
        return log.load_session(log.session_id).configs

    before = len(configs())
    client.predict(8, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False, api_name="/apply_knobs")
    wait_until(lambda: len(configs()) > before, timeout=10, what="the new config in the log")
    client.predict(4, 0.9, 2.0, 64, True, True, "recompute", "auto", "", 4.0, False, api_name="/apply_knobs")
    wait_until(lambda: len(configs()) > before + 1, timeout=10, what="the config after it")
    time.sleep(3 * POLL_S)  # a second report would come within a recorder poll or two
    logged = configs()[before:]
    assert [entry["config"]["block_size"] for entry in logged] == [8, 4]


def drawn_figure(page, element_id: str) -> dict:
    """The figure a plot shows now, as its Plotly div holds it (typed arrays as lists)."""
    return page.evaluate("""(id) => {
        const div = document.querySelector(`#${id} [data-testid="plotly"]`);
        if (!div || !div.data) return null;
        const plain = (value) => ArrayBuffer.isView(value) ? Array.from(value)
            : Array.isArray(value) ? value.map(plain) : value;
        return {data: div.data.map((trace) => Object.fromEntries(Object.entries(trace)
            .map(([key, value]) => [key, plain(value)]))), layout: {}};
    }""", element_id)


def test_browser_pause_and_step_back_show_the_pool_of_that_recorded_frame(
        served, client: Client, browser) -> None:
    from playwright.sync_api import expect

    engine = served[0]
    reference = PoolReference(engine)
    page = open_page(browser, served[2])
    try:
        Ticks(page).wait_for_first_drawing()  # the page's feed follows the pool from here
        run_a_request_the_scrubber_can_step_through(engine, reference)
        client.predict(api_name="/refresh_live")
        latest = int(client.predict(0, api_name="/pause")[0])
        target, status = scrub_back_to_held_blocks(  # found through the API, shown by the page
            lambda frame: client.predict(0, frame, api_name="/step_back"), latest, reference)
        index = delta_index(status)
        page.locator("#kv-pause").click()
        expect(page.locator("#kv-scrub-status")).to_contain_text("Paused at frame",
                                                                 timeout=15_000)
        page.locator("#kv-frame textarea, #kv-frame input").first.fill(str(target + 1))
        page.locator("#kv-step-back").click()
        expect(page.locator("#kv-scrub-status")).to_contain_text(
            f"Paused at frame {target} ", timeout=15_000)

        def heatmap_shown() -> bool:
            heatmap = drawn_figure(page, "kv-heatmap")
            codes = heatmap_state_codes(heatmap).ravel() if heatmap else []
            return [int(code) for code in codes if not np.isnan(code)] == reference.codes[index]

        def tables_shown() -> bool:  # the tables' row is drawn once it is on screen
            tables = drawn_figure(page, "kv-block-tables")
            return bool(tables and tables["data"] and tables["data"][0].get("text")) and (
                drawn_tables(tables) == reference.tables[index])
        page.locator("#kv-heatmap").scroll_into_view_if_needed()
        wait_until(heatmap_shown, timeout=20, what="the heatmap of that frame")
        page.locator("#kv-block-tables").scroll_into_view_if_needed()
        wait_until(tables_shown, timeout=20, what="the block tables of that frame")
        expect(page.locator("#kv-summary")).to_contain_text(f"paused at frame {target}")
    finally:
        page.close()
        reference.close()
