"""The Live tab read at a glance, in headless Chromium at the two widths a newcomer uses:
the heatmap of a pool above the one-cell-per-block limit fills its panel, and no text
(panel label, chart title, axis title, tick label, block id) is drawn over another."""

import threading

import pytest
from conftest import free_port
from test_dashboard import Ticks

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.ui import build_ui, page_options
from kvscope.ui.figures import MAX_CELLS

# The default pool of the report: above MAX_CELLS, so "whole pool" aggregates.
NUM_BLOCKS = 4403
VIEWPORTS = ((1440, 900), (1024, 768))


@pytest.fixture(scope="module")
def served_large(tiny_chat_model_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=NUM_BLOCKS, max_model_len=256, max_num_batched_tokens=64,
        max_num_seqs=2)).start()  # two at a time: the queued load lasts the whole test
    blocks = build_ui(engine)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True, **page_options())
    yield engine, f"http://127.0.0.1:{port}/"
    blocks.close()
    engine.shutdown()


# Every text of a panel that must stand alone: the panel's label, the chart title, the axis
# titles, the legend, the tick labels and the cells' texts (block ids), each with its box.
TEXT_BOXES = """(panel) => {
  const root = document.getElementById(panel);
  const boxes = [];
  const add = (kind, selector) => root.querySelectorAll(selector).forEach((el) => {
    const b = el.getBoundingClientRect();
    if (b.width > 0 && b.height > 0 && (el.textContent || kind === 'legend'))
      boxes.push({kind, text: (el.textContent || '').slice(0, 40), left: b.left,
                  right: b.right, top: b.top, bottom: b.bottom});
  });
  add('label', '[data-testid="block-label"]');
  add('title', '.gtitle');
  add('axis title', '.g-xtitle text, .g-ytitle text');
  add('legend', '.legend .bg');
  add('tick', '.xtick text, .ytick text');
  add('cell', '.heatmaplayer text');
  return boxes;
}"""


def overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """Pairs of texts whose boxes intersect (by more than a pixel: antialiasing)."""
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a["kind"] == b["kind"] == "tick":
                continue  # x against y ticks meet at the corner; same-axis below
            if min(a["right"], b["right"]) - max(a["left"], b["left"]) > 1 and \
                    min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > 1:
                found.append((f"{a['kind']} {a['text']!r}", f"{b['kind']} {b['text']!r}"))
    return found


def cut_off(page, panel: str, boxes: list[dict]) -> list[str]:
    """Titles reaching past the panel's sides or above its top (drawn there, cut off)."""
    edge = page.locator(f"#{panel}").bounding_box()
    return [box["text"] for box in boxes if box["kind"] in ("title", "axis title") and (
        box["left"] < edge["x"] - 1 or box["right"] > edge["x"] + edge["width"] + 1
        or box["top"] < edge["y"] - 1)]


def tick_overlaps(page, panel: str) -> list[tuple[str, str]]:
    """Neighbouring tick labels of one axis drawn over each other."""
    return page.evaluate("""(panel) => {
      const found = [];
      for (const axis of ['.xtick text', '.ytick text']) {
        const boxes = [...document.getElementById(panel).querySelectorAll(axis)]
          .map((el) => [el.textContent, el.getBoundingClientRect()])
          .filter(([, b]) => b.width > 0);
        boxes.sort((a, b) => axis[1] === 'x' ? a[1].left - b[1].left : a[1].top - b[1].top);
        for (let i = 1; i < boxes.length; i++) {
          const [t0, a] = boxes[i - 1], [t1, b] = boxes[i];
          const apart = axis[1] === 'x' ? b.left - a.right : b.top - a.bottom;
          if (apart < -1) found.push([t0, t1]);
        }
      }
      return found;
    }""", panel)


@pytest.mark.parametrize("viewport", VIEWPORTS, ids=lambda v: f"{v[0]}x{v[1]}")
def test_browser_panels_fill_their_width_and_no_text_covers_another(served_large, browser,
                                                                     viewport) -> None:
    engine, url = served_large
    assert engine.memory_plan.num_blocks > MAX_CELLS  # "whole pool" draws aggregate cells
    # Long tables (more block ids than fit a row at 32 columns) hold blocks meanwhile:
    # the tiny model finishes a request in a blink, so one is sent every 0.2 s.
    stop = threading.Event()

    def send() -> None:
        number = 0
        while not stop.wait(0.2):
            engine.submit([3 + (i + 7 * number) % 90 for i in range(200)],
                          SamplingParams(max_tokens=56, ignore_eos=True))
            number += 1
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    try:
        ticks = Ticks(page)
        page.goto(url)
        page.locator("#kv-heatmap .imagelayer image").wait_for(timeout=30_000)
        ticks.wait_for_first_drawing()
        page.locator("#kv-block-tables").scroll_into_view_if_needed()
        # A poll every 2 s while busy, and requests that finish in a blink: on a loaded
        # machine the first drawing that catches one holding blocks can take a while.
        page.locator("#kv-block-tables .heatmaplayer text").first.wait_for(timeout=90_000)
        page.locator("#kv-heatmap").scroll_into_view_if_needed()
        panel = page.locator("#kv-heatmap").bounding_box()
        image = page.locator("#kv-heatmap .imagelayer image").bounding_box()
        assert image["width"] >= 0.6 * panel["width"], (image, panel)
        for name in ("kv-heatmap", "kv-block-tables", "kv-prefix-tree", "kv-timeline",
                     "kv-series", "kv-comparison"):
            page.locator(f"#{name}").scroll_into_view_if_needed()
            boxes = page.evaluate(TEXT_BOXES, name)
            assert overlaps(boxes) == [], name
            assert cut_off(page, name, boxes) == [], name
            assert tick_overlaps(page, name) == [], name
        # A few blocks of a large pool in use: the usage axis follows them, not 0-100.
        usage_top = page.evaluate("document.querySelector('#kv-series .js-plotly-plot')"
                                  "._fullLayout.yaxis.range[1]")
        assert usage_top < 50
    finally:
        page.close()
        stop.set()
        sender.join()
