"""Screenshots of every dashboard tab, empty and under the load generator's traffic, at
the widths a newcomer uses (1440x900 and 1024x768), to look at before landing; the
1440-wide Live tab ones are also the README's pictures.

    .venv/bin/python bench/screenshots.py --out /tmp/shots  # look at them
    .venv/bin/python bench/screenshots.py --out /tmp/shots --readme  # and update the README's
    .venv/bin/python bench/screenshots.py --out /tmp/shots2 -- --replicas 2  # the Replicas tab

Each file is <tab>-<state>-<width>x<height>.png (state: empty, load, or paused: the Live
tab under load, paused by the step scrubber a few frames back); --readme copies
the 1440-wide Live tab ones to assets/dashboard-empty.png and assets/dashboard.png.
"""

import argparse
import shutil
import time
from pathlib import Path

from dashboard_overhead import DashboardTab  # noqa: E402
from served import ROOT, start_app, stop_app  # noqa: E402

VIEWPORTS = ((1440, 900), (1024, 768))
# The Replicas tab is there only when app.py runs more than one (`-- --replicas 2`).
TABS = (("live", "Live"), ("engine", "Engine & load"), ("sessions", "Sessions"),
        ("compare", "Compare"), ("replicas", "Replicas"))
# Long enough for the poller's busy tick (ui/panels.py BUSY_REFRESH_S) and its drawing.
WHOLE_PAGE_DRAW_S = 3.0


def shoot_whole_page(page, path: Path) -> None:
    """A screenshot of the whole page with every panel drawn at about the same moment.

    The page draws only the panels on screen (ui/live_poller.js), so a full-page shot of
    a normal viewport shows the panels below the fold as they were when last scrolled
    past: under load, a block-table panel saying no sequence holds blocks beside a
    summary counting 50 running. The viewport is stretched to the page's height for the
    shot, and the shot waits until the poller has drawn every panel once in it."""
    width, height = page.viewport_size["width"], page.viewport_size["height"]
    for _ in range(3):  # panels drawn in the taller viewport can change the page's height
        page.set_viewport_size({"width": width,
                                "height": page.evaluate("document.body.scrollHeight")})
        time.sleep(WHOLE_PAGE_DRAW_S)
    # Back to the real viewport first: a full-page shot of the stretched one would show
    # the space below a page that shrank as black.
    page.set_viewport_size({"width": width, "height": height})
    page.screenshot(path=path, full_page=True, timeout=120_000)


def shoot_tabs(page, out: Path, state: str, viewport: tuple[int, int]) -> None:
    """One full-page screenshot per tab the page has, ending on the Live tab."""
    size = f"{viewport[0]}x{viewport[1]}"
    for name, label in (*TABS[1:], TABS[0]):
        tab = page.get_by_role("tab", name=label)
        if not tab.count():
            continue
        tab.click()
        time.sleep(2)  # the tab's first refresh
        shoot_whole_page(page, out / f"{name}-{state}-{size}.png")


def shoot_paused(page, out: Path, viewport: tuple[int, int]) -> None:
    """The Live tab paused by the step scrubber, a few frames back from the latest."""
    page.locator("#kv-pause").click()
    page.locator("#kv-scrub-status").get_by_text("Paused at frame").wait_for(timeout=30_000)
    for _ in range(3):
        page.locator("#kv-step-back").click()
        time.sleep(0.5)
    time.sleep(2)  # every panel's drawing of that frame
    shoot_whole_page(page, out / f"live-paused-{viewport[0]}x{viewport[1]}.png")
    page.locator("#kv-resume").click()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the screenshots")
    parser.add_argument("--readme", action="store_true",
                        help="also update the README's two pictures in assets/")
    parser.add_argument("--load-s", type=float, default=25.0,
                        help="seconds of traffic before the loaded screenshots")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
    from playwright.sync_api import expect

    args.out.mkdir(parents=True, exist_ok=True)
    app = start_app(args.app_args)
    try:
        for index, viewport in enumerate(VIEWPORTS):
            with DashboardTab(app.url, viewport=viewport) as tab:
                page = tab.page
                if index == 0:  # the engine has run nothing yet
                    expect(page.get_by_text("No requests in this window yet")).to_be_visible(
                        timeout=60_000)
                    time.sleep(2)
                    shoot_tabs(page, args.out, "empty", viewport)
                    page.get_by_role("tab", name="Engine & load").click()
                    page.get_by_role("button", name="Send load").click()
                    page.get_by_role("tab", name="Live").click()
                    page.locator("#kv-message textarea").fill("What is a paged KV cache?")
                    page.locator("#kv-message textarea").press("Enter")
                    time.sleep(args.load_s)
                shoot_tabs(page, args.out, "load", viewport)
                if index == 0:
                    shoot_paused(page, args.out, viewport)
        if args.readme:
            shutil.copy(args.out / "live-empty-1440x900.png", ROOT / "assets/dashboard-empty.png")
            shutil.copy(args.out / "live-load-1440x900.png", ROOT / "assets/dashboard.png")
    finally:
        stop_app(app)


if __name__ == "__main__":
    main()
