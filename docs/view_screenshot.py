"""Take docs/attention-explorer.png, the README's picture of ``selfattn view``.

Run from the repository root: ``python docs/view_screenshot.py`` (needs the [models] extra,
playwright and Debian's chromium, as ``make test`` installs them).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from selfattn.cli import main

SENTENCE = "The animal didn't cross the street because it was too tired."
OUT = Path(__file__).with_name("attention-explorer.png")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def shoot() -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "attention.html"
        if main(["view", SENTENCE, "--out", str(page_path)]) != 0:
            sys.exit("selfattn view failed")
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(Path(tmp) / "profile"), executable_path="/usr/bin/chromium", args=ARGS,
                viewport={"width": 1180, "height": 760},
            )  # fmt: skip
            page = browser.new_page()
            page.goto(page_path.as_uri())
            ready = "document.body.dataset.ready === '1' && document.body.dataset.thumbs === 'done'"
            page.wait_for_function(ready)
            page.select_option("#layer", "2")
            page.wait_for_function(ready)
            for head in ("3", "9"):  # two more heads beside head 0, the last one focused
                page.click(f'.head-chip[data-head="{head}"]')
                page.wait_for_function(ready)
            page.hover("#head-view text.tok-left >> nth=10")  # "it": only its lines
            page.screenshot(path=str(OUT))
            browser.close()
    return OUT


if __name__ == "__main__":
    print(shoot())
