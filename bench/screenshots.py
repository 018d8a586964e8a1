"""The README's screenshots: the dashboard empty, then under the load generator's traffic.

    .venv/bin/python bench/screenshots.py            # writes assets/dashboard-empty.png
                                                     # and assets/dashboard.png
"""

import argparse
import time
from pathlib import Path

from dashboard_overhead import DashboardTab  # noqa: E402
from served import ROOT, start_app, stop_app  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets")
    parser.add_argument("--load-s", type=float, default=25.0,
                        help="seconds of traffic before the loaded screenshot")
    parser.add_argument("app_args", nargs="*", help="extra app.py flags (after --)")
    args = parser.parse_args()
    from playwright.sync_api import expect

    app = start_app(args.app_args)
    try:
        with DashboardTab(app.url, viewport=(1400, 1000)) as tab:
            page = tab.page
            expect(page.get_by_text("No requests in this window yet")).to_be_visible(
                timeout=60_000)
            time.sleep(2)
            page.screenshot(path=args.out / "dashboard-empty.png", full_page=True)
            page.get_by_role("tab", name="Engine & load").click()
            page.get_by_role("button", name="Send load").click()
            page.get_by_role("tab", name="Live").click()
            page.locator("#kv-message textarea").fill("What is a paged KV cache?")
            page.locator("#kv-message textarea").press("Enter")
            time.sleep(args.load_s)
            page.screenshot(path=args.out / "dashboard.png", full_page=True, timeout=120_000)
    finally:
        stop_app(app)


if __name__ == "__main__":
    main()
