"""The attention explorer page (``selfattn.inspect.write_view``) at model scale: its size, the
time to write it and to render it in headless Chromium, and whether the page ever freezes.

    python -m selfattn.benchmarks.view            # 12 layers x 12 heads x 256 tokens
    python -m selfattn.benchmarks.view --quick    # 2 x 2 x 32: a smoke run
    python -m selfattn.benchmarks.view --json

The maps are synthetic but shaped like real ones (seeded): per-head temperatures from nearly
uniform to peaked, plus a per-head pull towards nearby tokens. Rows:

- page bytes against the same maps as raw float32 (target <= 0.25: rounding to 3 decimals,
  byte planes and gzip must beat raw floats by 4x);
- write time (Python: round, encode, compress, fill the template);
- in Chromium (``--chromium``, default Debian's ``/usr/bin/chromium``; needs playwright): time
  until the head view, matrix and mask are drawn, until every thumbnail is drawn (one layer per
  animation frame), the switch to rollout, and the longest gap between animation frames while
  loading (target <= 1000 ms: the page never freezes for a second).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util
from selfattn.inspect import write_view

BYTES_TARGET = 0.25  # page bytes / raw float32 bytes
FREEZE_TARGET_MS = 1000.0  # the longest gap between animation frames while the page loads
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
READY = "document.body.dataset.ready === '1' && document.body.dataset.thumbs === 'done'"
# a requestAnimationFrame loop from the first script on: the longest gap is the worst freeze
FRAME_PROBE = """
window.__maxGap = 0;
(() => { let last = performance.now();
  const tick = (t) => { window.__maxGap = Math.max(window.__maxGap, t - last); last = t;
                        requestAnimationFrame(tick); };
  requestAnimationFrame(tick); })();
"""


def synthetic_maps(L: int, H: int, S: int, seed: int) -> torch.Tensor:
    """``(L, 1, H, S, S)`` softmax rows: temperatures spread over the heads, a local pull."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.linspace(0.5, 4.0, H).view(1, 1, H, 1, 1)
    scores = torch.randn(L, 1, H, S, S, generator=g) * temperature
    pos = torch.arange(S, dtype=torch.float32)
    distance = (pos.view(-1, 1) - pos).abs().view(1, 1, 1, S, S)
    pull = torch.rand(1, 1, H, 1, 1, generator=g) * 0.3
    return (scores - distance * pull).softmax(-1)


def browser_rows(path: Path, exe: str) -> list[dict]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=exe,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
        )
        page = context.new_page()
        page.add_init_script(FRAME_PROBE)
        start = time.perf_counter()
        page.goto(path.resolve().as_uri())
        page.wait_for_function("document.body.dataset.ready === '1'", timeout=120_000)
        ready_ms = (time.perf_counter() - start) * 1e3
        page.wait_for_function(READY, timeout=120_000)
        thumbs_ms = (time.perf_counter() - start) * 1e3
        gap_ms = float(page.evaluate("window.__maxGap"))
        start = time.perf_counter()
        page.check("input[value=rollout]")
        page.wait_for_function(READY, timeout=120_000)
        switch_ms = (time.perf_counter() - start) * 1e3
        context.close()
    return [
        {"case": "open the page: head view, matrix and mask drawn", "ours_ms": ready_ms},
        {"case": "open the page: every thumbnail drawn", "ours_ms": thumbs_ms},
        {"case": "switch to rollout: everything redrawn", "ours_ms": switch_ms},
        {"case": "longest gap between animation frames while opening", "ours_ms": gap_ms,
         "target": f"<= {FREEZE_TARGET_MS:g}", "met": gap_ms <= FREEZE_TARGET_MS},
    ]  # fmt: skip


def run(args) -> dict:
    L, H, S = args.layers, args.heads, args.tokens
    maps = synthetic_maps(L, H, S, args.seed)
    tokens = [f"tok{i}" for i in range(S)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "page.html"
        start = time.perf_counter()
        write_view(maps, tokens, path)
        write_ms = (time.perf_counter() - start) * 1e3
        ours, peer = path.stat().st_size, maps.numel() * 4
        rows = [
            {"case": "page bytes / the maps as raw float32", "ours_bytes": ours,
             "peer": "raw float32", "peer_bytes": peer, "ratio": ours / peer,
             "target": f"<= {BYTES_TARGET}", "met": ours / peer <= BYTES_TARGET},
            {"case": "write_view (round, encode, gzip, template)", "ours_ms": write_ms},
        ]  # fmt: skip
        exe = shutil.which(args.chromium)
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            exe, why = None, "playwright is not installed (pip install playwright)"
        else:
            why = f"no browser at {args.chromium} (apt-get install chromium)"
        if exe is None:
            rows.append({"case": "in Chromium", "skipped": why})
        else:
            rows += browser_rows(path, exe)
    setup = {"layers": L, "heads": H, "tokens": S, "weights": maps.numel(), "chromium": exe}
    return {"machine": _util.machine(), "setup": setup, "rows": rows}


_COLUMNS = ["case", "ours", "ours/peer", "target", "met?"]


def _table(report: dict) -> list[list[str]]:
    table = []
    for r in report["rows"]:
        if "skipped" in r:
            table.append([r["case"], r["skipped"], "", "", ""])
            continue
        value = f"{r['ours_bytes']:,} B" if "ours_bytes" in r else f"{r['ours_ms']:.0f} ms"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        table.append([r["case"], value, ratio, r.get("target", ""), _util.verdict(r)])
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers x 2 heads x 32 tokens")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--layers", type=int, default=None, help="default 12 (quick 2)")
    p.add_argument("--heads", type=int, default=None, help="default 12 (quick 2)")
    p.add_argument("--tokens", type=int, default=None, help="default 256 (quick 32)")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="the browser to drive")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.quick else 12)
    args.heads = args.heads or (2 if args.quick else 12)
    args.tokens = args.tokens or (32 if args.quick else 256)
    _util.print_report(run(args), args.json, _COLUMNS, _table, "attention explorer page")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
