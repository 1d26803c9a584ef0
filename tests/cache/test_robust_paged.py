"""paged_attention under hostile inputs and surroundings, on each of its paths.

The C kernel, the PyTorch path and the Triton kernel (interpreted on CPU, TRITON_INTERPRET=1)
must agree: NaN/inf in V reaches only the rows that attend its key, garbage beyond
``seq_lens`` or in other pages reaches none, a score mod that leaves a row nothing gives 0 and
lse -inf, torch's default dtype changes nothing, and the C kernel never loads a library that
another user could have written.
"""

from __future__ import annotations

import math
import os
import shutil
import stat
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.backends.paged import pytorch as paged_torch
from selfattn.backends.paged._intervals import key_intervals
from selfattn.cache import paged_attention
from selfattn.cache.quant import quantize_fp8, quantize_int8
from selfattn.kernels import build, paged_decode
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import check, contiguous, make_paged, spy_paged_backends


@pytest.fixture(params=["cpu", "torch", "triton"])
def paged_path(request, monkeypatch) -> list[str]:
    """Run a test on one of paged_attention's backends; the list records the backends that ran."""
    if request.param == "torch":
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    elif request.param == "cpu":
        c_kernel(paged_decode)
    elif request.param == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not 1")
        monkeypatch.setenv("SELFATTN_PAGED_TRITON", "1")
    ran = spy_paged_backends(monkeypatch)
    yield ran
    assert ran and set(ran) == {request.param}, f"{request.param} was asked for, but {ran} ran"


def _page_slot(table, P, b, t):
    """(page, slot) of sequence ``b``'s token ``t``."""
    return int(table[b, t // P]), t % P


# -- non-finite values --------------------------------------------------------------------------


# Triton's interpreter multiplies with numpy, which warns when NaN meets the matmul.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nonfinite_v_reaches_only_rows_that_attend_its_key(paged_path, dtype, monkeypatch):
    """Sequence 0 has 12 tokens, queries at positions 5..11 under a causal window of 3: key 6 is
    attended by rows 1-3 only, key 8 by rows 3-5 only. NaN at key 6 (kv head 0, dim 3) and +inf
    at key 8 (kv head 1, dim 0) must poison exactly those (row, head, dim) outputs. The PyTorch
    path walks one page per step, so its second walk re-sums some groups and not others."""
    monkeypatch.setattr(paged_torch, "GROUP_KEYS", 4)
    Hq, Hkv, D, P, Sq = 4, 2, 8, 4, 7
    mask = masks.causal() & masks.sliding_window(3)
    q, kp, vp, table, lens = make_paged([12, 7], Hq, Hkv, D, P, Sq=Sq, dtype=dtype, seed=31)
    dirty = vp.clone()
    dirty[_page_slot(table, P, 0, 6)][0, 3] = math.nan
    dirty[_page_slot(table, P, 0, 8)][1, 0] = math.inf
    out, lse = paged_attention(q, kp, dirty, table, lens, mask=mask, return_lse=True)

    want_nan = torch.zeros(out.shape, dtype=torch.bool)
    want_nan[0, 0:2, 1:4, 3] = True  # heads of kv head 0, rows at positions 6, 7, 8
    want_inf = torch.zeros(out.shape, dtype=torch.bool)
    want_inf[0, 2:4, 3:6, 0] = True  # heads of kv head 1, rows at positions 8, 9, 10
    assert torch.equal(out.isnan(), want_nan), f"NaN at {out.isnan().nonzero().tolist()}"
    assert torch.equal(out.isposinf(), want_inf), f"+inf at {out.isposinf().nonzero().tolist()}"
    assert not bool(out.isneginf().any()) and bool(torch.isfinite(lse).all())
    # every other output: the clean cache's value, within the ratio rule
    finite = ~(want_nan | want_inf)
    for b, n in enumerate(lens.tolist()):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        o64, _, _ = reference_attention(q[b : b + 1], kb, vb, mask=mask)
        naive, _, _ = naive_attention(q[b : b + 1], kb, vb, mask=mask)
        keep = finite[b : b + 1]
        assert_close_to_reference(
            out[b : b + 1].where(keep, 0), o64.where(keep, 0), naive.where(keep, 0),
            dtype=dtype, what=f"finite out[{b}]",
        )  # fmt: skip


@pytest.mark.parametrize("mask", [None, masks.causal() & masks.sliding_window(3)])
def test_garbage_outside_attended_keys_never_leaks(paged_path, mask):
    """NaN/inf in every K/V slot that no query attends (unwritten slots past seq_lens, keys left
    of the window, pages of no sequence): the result is bit-identical to a clean cache's."""
    Sq, P = 3, 4
    q, kp, vp, table, lens = make_paged([13, 6, 10], 4, 2, D=8, P=P, Sq=Sq, spare=4, seed=5)
    clean = paged_attention(q, kp, vp, table, lens, mask=mask, return_lse=True)
    lo, hi = key_intervals(mask, lens.long(), Sq)
    attended = torch.zeros(kp.shape[:2], dtype=torch.bool)  # (N, P)
    for b in range(len(lens)):
        for t in range(int(lo[b].min()), int(hi[b].max())):
            attended[_page_slot(table, P, b, t)] = True
    kd, vd = kp.clone(), vp.clone()
    kd[~attended], vd[~attended] = math.nan, math.inf
    vd[~attended & (torch.arange(P) % 2 == 0)] = math.nan
    dirty = paged_attention(q, kd, vd, table, lens, mask=mask, return_lse=True)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


def test_score_mod_that_leaves_a_row_nothing_gives_zero_beside_nan_v(monkeypatch):
    """PyTorch path (the one with score mods; the comparisons take it too). One sequence of 9
    tokens, queries at positions 5-8, causal; the score mod wipes out every score of the rows at
    even positions (6, 8); V of key 6 is NaN. Rows 6 and 8: exactly 0, lse -inf. Row 5 does not
    attend key 6: finite and exact. Row 7 attends it: NaN. A score mod that gives key 6 -inf
    for every row hides it."""
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    q, kp, vp, table, lens = make_paged([9], 2, 1, D=8, P=4, Sq=4, seed=17)
    vp[_page_slot(table, 4, 0, 6)] = math.nan

    def wipe_even_rows(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 2 == 0, -math.inf, s)

    out, lse = paged_attention(
        q, kp, vp, table, lens, mask=masks.causal(), score_mod=wipe_even_rows, return_lse=True
    )
    assert bool((out[:, :, [1, 3]] == 0).all()) and bool(lse[:, :, [1, 3]].isneginf().all())
    assert bool(out[:, :, 2].isnan().all())
    clean = make_paged([9], 2, 1, D=8, P=4, Sq=4, seed=17)[2]
    ref = paged_attention(q, kp, clean, table, lens, mask=masks.causal(), return_lse=True)
    torch.testing.assert_close(out[:, :, 0], ref[0][:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :, 0], ref[1][:, :, 0], rtol=0, atol=0)

    def hide_key_6(s, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 6, -math.inf, s)

    out = paged_attention(q, kp, vp, table, lens, mask=masks.causal(), score_mod=hide_key_6)
    ref = paged_attention(
        q, kp, clean, table, lens, mask=lambda b, h, qi, kv: (kv <= qi) & (kv != 6)
    )
    torch.testing.assert_close(out, ref)


# -- torch's default dtype ----------------------------------------------------------------------


@pytest.fixture(params=[torch.float64, torch.float16, torch.bfloat16], ids=str)
def default_dtype(request):
    """A default dtype for the test to switch to; the float32 default is restored after it."""
    old = torch.get_default_dtype()
    yield request.param
    torch.set_default_dtype(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_result_does_not_depend_on_default_dtype(paged_path, default_dtype, dtype):
    """The C kernel allocated its float32 outputs with the default dtype: wrong by ~0.5 under
    float64, a heap overflow (abort) under float16/bfloat16."""
    q, kp, vp, table, lens = make_paged([11, 6], 4, 2, D=8, P=4, Sq=2, dtype=dtype, seed=3)
    want = check(q, kp, vp, table, lens, mask=masks.causal())
    torch.set_default_dtype(default_dtype)
    got = paged_attention(q, kp, vp, table, lens, mask=masks.causal(), return_lse=True)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("backend", ["auto", "reference", "chunked", "sdpa"])
def test_attention_does_not_depend_on_default_dtype(default_dtype, backend):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g, dtype=torch.float32) for _ in range(3))
    kw = dict(mask=masks.causal() & masks.sliding_window(4), backend=backend, return_lse=True)
    want = sa.attention(q, k, v, **kw)
    torch.set_default_dtype(default_dtype)
    got = sa.attention(q, k, v, **kw)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize(
    "quantize, want", [(quantize_int8, torch.bfloat16), (quantize_fp8, torch.float32)]
)
def test_quantised_scales_keep_their_dtype_whatever_the_default_dtype(
    default_dtype, quantize, want
):
    """Scales of an empty page pool were made with the default dtype; paged_attention wants
    int8's bfloat16 and fp8's float32 scales."""
    torch.set_default_dtype(default_dtype)
    _, scales = quantize(torch.zeros(0, 4, 2, 8, dtype=torch.float32))
    assert scales.dtype == want


# -- the C kernel's build cache -----------------------------------------------------------------


@pytest.fixture(scope="module")
def library_file(tmp_path_factory) -> Path:
    """A built kernel library: the session's own, or (when that was built in a temporary dir
    that is gone) one real build."""
    lib = c_kernel(paged_decode)
    if Path(lib._name).is_file():
        return Path(lib._name)
    spec = paged_decode.SPEC
    out = tmp_path_factory.mktemp("built")
    return build.compile_library(spec, build.compiler(), list(spec.flags), out, "lib.so")


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path, library_file):
    """``SELFATTN_CACHE_DIR`` under ``tmp_path`` and a stand-in compiler that copies a built
    library (the compiler is slow; the trust checks are under test). Returns the cache path and
    the list of directories the builds ran in."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(cache))
    built_in: list[Path] = []

    def cc(cmd, **kw):
        out = Path(cmd[cmd.index("-o") + 1])  # in a temporary dir inside the build dir
        built_in.append(out.parent.parent)
        shutil.copy(library_file, out)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", cc)
    return cache, built_in


def _library_name() -> str:
    """The file name the cache gives this machine's library (as the session's own build)."""
    return Path(paged_decode.library()._name).name


def _runs_correctly(monkeypatch, lib) -> None:
    """paged_attention through ``lib`` (the C kernel) gives the reference's numbers."""
    assert lib is not None
    monkeypatch.setattr(paged_decode, "_library_once", lambda: lib)
    q, kp, vp, table, lens = make_paged([13, 6], 4, 2, D=8, P=4, Sq=2, seed=23)
    explained = sa.backends.explain_paged(
        q, kp, vp, table, lens, mask=masks.causal(), print_table=False
    )
    assert explained.chosen == "cpu"
    check(q, kp, vp, table, lens, mask=masks.causal())


def _refused(caplog, cache, built_in, what: str) -> None:
    """The cache was refused with one log line naming ``what``; the build went elsewhere."""
    warnings = [r for r in caplog.records if r.name == "selfattn" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and what in warnings[0].getMessage(), caplog.text
    assert "private temporary directory" in warnings[0].getMessage()
    assert built_in and all(d != cache and cache not in d.parents for d in built_in)


def test_cache_dir_is_created_private(kernel_cache, monkeypatch, caplog):
    """The cache dir and the dirs made above it are 0700; the library is writable by no other."""
    cache, built_in = kernel_cache
    cache = cache / "below"
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(cache))
    lib = build.load(paged_decode.SPEC)
    for d in (cache, cache.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, f"{d}: {stat.filemode(d.stat().st_mode)}"
    assert built_in == [cache] and not caplog.records
    (so,) = cache.iterdir()
    assert not so.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    _runs_correctly(monkeypatch, lib)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=oct)
def test_writable_cache_dir_is_refused(kernel_cache, monkeypatch, caplog, mode):
    cache, built_in = kernel_cache
    cache.mkdir(mode=0o700)
    cache.chmod(mode)
    lib = build.load(paged_decode.SPEC)
    _refused(caplog, cache, built_in, "group- or world-writable")
    assert list(cache.iterdir()) == []
    _runs_correctly(monkeypatch, lib)


def test_cache_dir_that_cannot_be_created_builds_privately(kernel_cache, monkeypatch, caplog):
    """A cache path below a regular file: the kernel still runs (it used to be given up)."""
    cache, built_in = kernel_cache
    cache.write_text("a file, not a directory")
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(cache / "below"))
    lib = build.load(paged_decode.SPEC)
    _refused(caplog, cache, built_in, "cannot be created")
    _runs_correctly(monkeypatch, lib)


def _fallback_logged(caplog, what: str) -> None:
    """One ``selfattn`` warning naming ``what`` and that the PyTorch path runs."""
    warnings = [r for r in caplog.records if r.name == "selfattn" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and what in warnings[0].getMessage(), caplog.text
    assert "PyTorch path runs instead" in warnings[0].getMessage()


def test_no_compiler_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.load(paged_decode.SPEC) is None
    _fallback_logged(caplog, "no C compiler found")


def test_failed_build_is_logged_with_the_compiler_error(kernel_cache, monkeypatch, caplog):
    """Every target's build fails: the compiler's last line reaches the log, once."""

    def broken(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd, stderr=b"x.c:1: error: no such instruction")

    monkeypatch.setattr(subprocess, "run", broken)
    assert build.load(paged_decode.SPEC) is None
    _fallback_logged(caplog, "no such instruction")


def test_cache_dir_of_another_user_is_refused(kernel_cache, monkeypatch, caplog):
    """Tests run as root, so "another user" is this user seen through a different uid."""
    cache, built_in = kernel_cache
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: cache.stat().st_uid + 4242)
    lib = build.load(paged_decode.SPEC)
    _refused(caplog, cache, built_in, f"owned by uid {cache.stat().st_uid}")
    _runs_correctly(monkeypatch, lib)


@pytest.mark.parametrize("sticky", [False, True])
def test_cache_dir_under_a_world_writable_dir(kernel_cache, monkeypatch, caplog, sticky):
    """Without the sticky bit anyone may rename the cache dir away and put theirs in its place;
    with it (``/tmp``) only its owner may."""
    cache, built_in = kernel_cache
    cache.parent.chmod(0o1777 if sticky else 0o777)
    lib = build.load(paged_decode.SPEC)
    if sticky:
        assert not caplog.records and built_in == [cache]
    else:
        _refused(caplog, cache, built_in, "without the sticky bit")
    _runs_correctly(monkeypatch, lib)


@pytest.mark.parametrize("target_mode", [0o700, 0o777], ids=oct)
def test_symlinked_cache_dir_is_judged_by_its_target(
    kernel_cache, monkeypatch, caplog, target_mode
):
    cache, built_in = kernel_cache
    target = cache.parent / "elsewhere"
    target.mkdir(mode=0o700)
    target.chmod(target_mode)
    cache.symlink_to(target)
    lib = build.load(paged_decode.SPEC)
    if target_mode == 0o700:
        assert not caplog.records and built_in == [target]
        assert len(list(target.iterdir())) == 1
    else:
        _refused(caplog, target, built_in, "group- or world-writable")
    _runs_correctly(monkeypatch, lib)


@pytest.mark.parametrize("bad", ["group-writable", "symlink"])
def test_untrusted_cached_library_is_not_loaded(kernel_cache, monkeypatch, caplog, bad):
    """A planted library under the expected name: a group-writable file, or a symlink to one
    elsewhere. Neither is loaded (dlopen would run its constructors)."""
    cache, built_in = kernel_cache
    cache.mkdir(mode=0o700)
    name = _library_name()
    planted = cache.parent / "planted.so"
    planted.write_bytes(b"not a library: loading it would fail")
    if bad == "symlink":
        (cache / name).symlink_to(planted)
    else:
        shutil.copy(planted, cache / name)
        (cache / name).chmod(0o664)
    lib = build.load(paged_decode.SPEC)
    _refused(caplog, cache, built_in, "symbolic link" if bad == "symlink" else "group- or world")
    _runs_correctly(monkeypatch, lib)


def test_concurrent_builds_compile_once(kernel_cache, monkeypatch):
    """Two builders of one empty cache (threads here, processes alike): the second waits on the
    first's lock of the cache dir, then loads its library instead of compiling it again. No
    lock file is left behind."""
    cache, built_in = kernel_cache
    copy_library = subprocess.run  # the fixture's stand-in compiler
    compiling = threading.Event()

    def slow_compiler(cmd, **kw):
        compiling.set()
        time.sleep(0.3)  # a build in progress while the other builder looks for the library
        return copy_library(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", slow_compiler)
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda _: build.load(paged_decode.SPEC), range(2)))
    assert compiling.is_set() and all(lib is not None for lib in libs)
    assert built_in == [cache], f"compiled {len(built_in)} times"
    assert [p.suffix for p in cache.iterdir()] == [".so"]
    _runs_correctly(monkeypatch, libs[1])


def test_a_stuck_build_lock_is_waited_on_for_a_bounded_time(kernel_cache, monkeypatch, caplog):
    """A builder that holds the cache's lock and never finishes (stopped, hung on a network file
    system) delays the others by LOCK_WAIT_S at most, then they build anyway (logged)."""
    fcntl = pytest.importorskip("fcntl")
    cache, built_in = kernel_cache
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(build, "LOCK_WAIT_S", 0.2)
    stuck = os.open(cache, os.O_RDONLY)
    fcntl.flock(stuck, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        lib = build.load(paged_decode.SPEC)
        waited = time.monotonic() - start
    finally:
        os.close(stuck)
    assert lib is not None and built_in == [cache] and 0.2 <= waited < 5
    assert "building without waiting" in caplog.text
    _runs_correctly(monkeypatch, lib)


def test_library_missing_a_symbol_falls_back_to_pytorch(monkeypatch, tmp_path, caplog):
    """A loadable library under the expected name without the kernel's functions: logged, and
    paged_attention runs its PyTorch path (it used to raise AttributeError on every call)."""
    c_kernel(paged_decode)
    cc, name = build.compiler(), _library_name()
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    src = tmp_path / "other.c"
    src.write_text("int has_f16(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(tmp_path / name)], check=True)
    src.unlink()
    lib = build.load(paged_decode.SPEC)
    assert lib is None
    (warning,) = [r for r in caplog.records if r.name == "selfattn"]
    assert "lacks paged_decode" in warning.getMessage()
    monkeypatch.setattr(paged_decode, "_library_once", lambda: lib)
    q, kp, vp, table, lens = make_paged([13, 6], 4, 2, D=8, P=4, Sq=2, seed=29)
    explained = sa.backends.explain_paged(
        q, kp, vp, table, lens, mask=masks.causal(), print_table=False
    )
    assert explained.chosen == "torch"
    check(q, kp, vp, table, lens, mask=masks.causal())
