"""Clipped text over every dashboard tab, read from the DOM: an element showing text whose
content is wider than its box (scrollWidth > clientWidth) where its box cuts it off
(overflow hidden, clip, auto or scroll, or an ellipsis), text reaching past a box around it
that cuts, or a word of it broken across two lines, at 1280x900 and 1920x1080. Prints
JSON; the target is 0 clipped.

    .venv/bin/python bench/clipped_text.py
    .venv/bin/python bench/clipped_text.py -- --replicas 2  # with the Replicas tab

The Live tab is read empty and under the load generator's traffic (long ids, counts).
"""

import argparse
import json
import time

from dashboard_overhead import DashboardTab  # noqa: E402
from screenshots import TABS  # noqa: E402
from served import start_app, stop_app  # noqa: E402

VIEWPORTS = ((1280, 900), (1920, 1080))
# Every element on screen with text of its own that its box cuts, or whose words it breaks:
# (tag#id.class, text, why, widths). Plotly's SVG text has no scrollWidth; its overlaps
# are tests/test_dashboard_layout.py's.
CLIPPED_TEXT_JS = """() => {
  const cut = new Set(['hidden', 'clip', 'auto', 'scroll']);
  const found = [];
  for (const el of document.body.querySelectorAll('*')) {
    // 1 px boxes are screen-reader text, hidden from sight on purpose (.sr-only); what is
    // aria-hidden is shown to no one (Gradio's copy of the tab bar, measured off screen).
    if (el.closest('svg, [aria-hidden="true"]') || el.getBoundingClientRect().width <= 1)
      continue;
    const texts = [...el.childNodes].filter((n) => n.nodeType === 3 && n.textContent.trim());
    if (!texts.length) continue;
    const style = getComputedStyle(el);
    if (style.visibility === 'hidden' || style.display === 'none') continue;
    const name = el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
      (typeof el.className === 'string' && el.className ? '.' +
       el.className.trim().split(/\\s+/).join('.') : '');
    const report = (why) => found.push({
      element: name.slice(0, 80), text: el.textContent.trim().slice(0, 60), why,
      scroll_width: el.scrollWidth, client_width: el.clientWidth});
    if (el.scrollWidth > el.clientWidth + 1 &&
        (cut.has(style.overflowX) || style.textOverflow === 'ellipsis')) {
      report('cut off');
      continue;
    }
    // Cut by a box around it: the text's own extent against each clipping ancestor's.
    const whole = document.createRange();
    whole.selectNodeContents(el);
    const text = whole.getBoundingClientRect();
    let cutter = null;
    for (let up = el.parentElement; up && up !== document.body && !cutter;
         up = up.parentElement) {
      if (!cut.has(getComputedStyle(up).overflowX)) continue;
      const box = up.getBoundingClientRect();
      if (text.left < box.left - 1 || text.right > box.right + 1) cutter = up;
    }
    if (cutter) {
      report('cut off by ' + cutter.tagName.toLowerCase() + '.' +
             String(cutter.className).trim().split(/\\s+/).join('.'));
      continue;
    }
    // A word drawn on two lines ("ru" above "n 1"): its range has a box on each line.
    const range = document.createRange();
    const broken = texts.some((node) => {
      for (const match of node.textContent.matchAll(/\\S+/g)) {
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) return true;
      }
      return false;
    });
    if (broken) report('a word broken across lines');
  }
  return found;
}"""
TAB_DRAW_S = 3.0  # a tab's first refresh and its drawing


def clipped_on_tabs(page) -> dict[str, list[dict]]:
    """{tab: its clipped text elements} for every tab the page has."""
    found = {}
    for name, label in TABS:
        tab = page.get_by_role("tab", name=label)
        if not tab.count():
            continue
        tab.click()
        time.sleep(TAB_DRAW_S)
        found[name] = page.evaluate(CLIPPED_TEXT_JS)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-s", type=float, default=15.0,
                        help="seconds of traffic before the loaded reading")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
    app = start_app(args.app_args)
    results = {}
    try:
        for index, viewport in enumerate(VIEWPORTS):
            size = f"{viewport[0]}x{viewport[1]}"
            with DashboardTab(app.url, viewport=viewport) as tab:
                page = tab.page
                if index == 0:  # the engine has run nothing yet
                    page.get_by_text("No requests in this window yet").wait_for(
                        timeout=60_000)
                    results[f"empty {size}"] = clipped_on_tabs(page)
                    page.get_by_role("tab", name="Engine & load").click()
                    page.get_by_role("button", name="Send load").click()
                    time.sleep(args.load_s)
                results[f"load {size}"] = clipped_on_tabs(page)
    finally:
        stop_app(app)
    total = sum(len(found) for tabs in results.values() for found in tabs.values())
    print(json.dumps({"clipped_text_elements": total, "by_reading": results}, indent=1))


if __name__ == "__main__":
    main()
