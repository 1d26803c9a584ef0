"""Masks: dense matrices against their defining formulas, tile classification against the dense
matrices (hypothesis), the algebra, rendering, and every error path.

The expected matrices are written here with numpy from the formulas in docs/design.md, independently
of ``selfattn.masks``: query row ``r`` sits at absolute position ``i = q_offset + r`` (default
``Sk - Sq``), key column ``c`` at ``j = kv_offset + c``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfattn as sa
from selfattn import masks as M
from selfattn.masks import EMPTY, FULL, PARTIAL, TileGrid

# ----------------------------------------------------------------------------------------------
# Independent formulas. Each takes numpy index arrays b (B,1,1,1), h (1,H,1,1), i (1,1,Sq,1) and
# j (1,1,1,Sk) of absolute positions and returns a bool array broadcastable to (B, H, Sq, Sk).
# ----------------------------------------------------------------------------------------------


def f_causal():
    return lambda b, h, i, j: j <= i


def f_window(w):
    return lambda b, h, i, j: (i - w < j) & (j <= i)


def f_chunked(s, causal=True):
    def f(b, h, i, j):
        same = np.floor_divide(i, s) == np.floor_divide(j, s)
        return same & (j <= i) if causal else same

    return f


def f_padding(lengths):
    n = np.asarray(lengths).reshape(-1, 1, 1, 1)
    return lambda b, h, i, j: j < n


def f_documents(ids):
    ids = np.asarray(ids)
    ids2 = ids if ids.ndim == 2 else ids[None]

    def f(b, h, i, j):
        bb = b if ids2.shape[0] > 1 else np.zeros_like(b)
        return ids2[bb, i] == ids2[bb, j]

    return f


def f_prefix(n):
    n = np.asarray(n).reshape(-1, 1, 1, 1)
    return lambda b, h, i, j: (j < n) | (j <= i)


def f_block_sparse(layout, bq, bk):
    lay = np.asarray(layout)
    while lay.ndim < 4:
        lay = lay[None]

    def f(b, h, i, j):
        bb = b if lay.shape[0] > 1 else np.zeros_like(b)
        hh = h if lay.shape[1] > 1 else np.zeros_like(h)
        return lay[bb, hh, i // bq, j // bk]

    return f


def f_tensor(t, q_offset):
    """A row-ordered bool tensor: row = i - q_offset (the call's row), column = key position."""
    t = np.asarray(t)
    while t.ndim < 4:
        t = t[None]

    def f(b, h, i, j):
        idx = [x if n > 1 else np.zeros_like(x) for x, n in zip((b, h, i - q_offset, j), t.shape)]
        return t[idx[0], idx[1], idx[2], idx[3]]

    return f


def truth(f, B, H, Sq, Sk, q_offset, kv_offset=0) -> np.ndarray:
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    i = (np.arange(Sq) + q_offset).reshape(1, 1, Sq, 1)
    j = (np.arange(Sk) + kv_offset).reshape(1, 1, 1, Sk)
    return np.broadcast_to(f(b, h, i, j), (B, H, Sq, Sk))


def tile_truth(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """Exact tile kinds (B, H, n_q, n_k) of a dense (B, H, Sq, Sk) bool array, by loops."""
    B, H, Sq, Sk = dense.shape
    n_q, n_k = -(-Sq // bq), -(-Sk // bk)
    out = np.empty((B, H, n_q, n_k), dtype=np.int8)
    for t in range(n_q):
        for u in range(n_k):
            tile = dense[:, :, t * bq : (t + 1) * bq, u * bk : (u + 1) * bk]
            anyv, allv = tile.any(axis=(2, 3)), tile.all(axis=(2, 3))
            out[:, :, t, u] = np.where(allv, int(FULL), np.where(anyv, int(PARTIAL), int(EMPTY)))
    return out


def dense_of(mask, Sq, Sk, B=1, H=1, q_offset=None) -> np.ndarray:
    return mask.to_dense(Sq, Sk, B=B, H=H, q_offset=q_offset).numpy()


# ----------------------------------------------------------------------------------------------
# Each built-in against its formula
# ----------------------------------------------------------------------------------------------

SHAPES = [(1, 1), (1, 7), (7, 1), (5, 9), (9, 5), (6, 6)]


def _offsets(Sq, Sk):
    return [None, 0, -3, Sk + 2]


def _builtin_cases():
    return [
        ("causal", lambda: M.causal(), f_causal()),
        ("window1", lambda: M.sliding_window(1), f_window(1)),
        ("window3", lambda: M.sliding_window(3), f_window(3)),
        ("chunked3", lambda: M.chunked(3), f_chunked(3)),
        ("chunked4_bidir", lambda: M.chunked(4, causal=False), f_chunked(4, causal=False)),
        ("prefix2", lambda: M.prefix_lm(2), f_prefix(2)),
        ("prefix_per_batch", lambda: M.prefix_lm([0, 3]), f_prefix([0, 3])),
        ("padding_int", lambda: M.padding(1), f_padding(1)),
    ]


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_position_masks_match_formula(Sq, Sk):
    for name, make, f in _builtin_cases():
        for q_offset in _offsets(Sq, Sk):
            off = Sk - Sq if q_offset is None else q_offset
            got = dense_of(make(), Sq, Sk, B=2, H=3, q_offset=q_offset)
            want = truth(f, 2, 3, Sq, Sk, off)
            assert got.shape == (2, 3, Sq, Sk), name
            np.testing.assert_array_equal(got, want, err_msg=f"{name} q_offset={q_offset}")


@pytest.mark.parametrize("Sq,Sk", SHAPES)
def test_data_masks_match_formula(Sq, Sk):
    rng = np.random.default_rng(Sq * 100 + Sk)
    B, H = 3, 2
    lengths = rng.integers(0, Sk + 1, size=B)
    got = dense_of(M.padding(torch.tensor(lengths)), Sq, Sk, B=B, H=H)
    np.testing.assert_array_equal(got, truth(f_padding(lengths), B, H, Sq, Sk, Sk - Sq))

    for q_offset in (None, 0, 2):
        off = Sk - Sq if q_offset is None else q_offset
        if off < 0:
            continue
        S = max(Sk, off + Sq) + 2
        ids = np.sort(rng.integers(0, 4, size=(B, S)), axis=1)
        got = dense_of(M.documents(torch.tensor(ids)), Sq, Sk, B=B, H=H, q_offset=q_offset)
        np.testing.assert_array_equal(got, truth(f_documents(ids), B, H, Sq, Sk, off))
        ids1 = rng.integers(0, 3, size=S)  # unsorted, shared by the batch
        got = dense_of(M.documents(ids1.tolist()), Sq, Sk, B=B, H=H, q_offset=q_offset)
        np.testing.assert_array_equal(got, truth(f_documents(ids1), B, H, Sq, Sk, off))

        bq, bk = 2, 3
        nq, nk = -(-(off + Sq) // bq), -(-Sk // bk)
        layout = rng.random((H, nq, nk)) < 0.5
        m = M.block_sparse(torch.tensor(layout), (bq, bk))
        got = dense_of(m, Sq, Sk, B=B, H=H, q_offset=q_offset)
        np.testing.assert_array_equal(got, truth(f_block_sparse(layout, bq, bk), B, H, Sq, Sk, off))

    t = rng.random((B, 1, Sq, Sk)) < 0.5
    for q_offset in (None, 0, 5):
        got = dense_of(M.from_tensor(torch.tensor(t)), Sq, Sk, B=B, H=H, q_offset=q_offset)
        np.testing.assert_array_equal(got, np.broadcast_to(t, (B, H, Sq, Sk)))


def test_default_alignment_is_bottom_right():
    # Sq=2, Sk=5: rows sit at positions 3 and 4 (the picture in docs/design.md / causal's docstring)
    assert M.causal().render(2, 5) == "████·\n█████"
    # Sq > Sk: the top rows sit at negative positions and see nothing
    want = np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(dense_of(M.causal(), 5, 3)[0, 0], want)
    # explicit q_offset=0 is top-left
    np.testing.assert_array_equal(dense_of(M.causal(), 2, 5, q_offset=0)[0, 0], np.tri(2, 5) > 0)


@pytest.mark.parametrize("Sq,Sk", [(1, 1), (4, 9), (9, 4), (7, 7)])
def test_sliding_window_limits(Sq, Sk):
    for q_offset in (None, 0, 3):
        off = Sk - Sq if q_offset is None else q_offset
        # a window reaching back past key 0 from every query is causal: size > last position
        top = max(Sk, off + Sq)
        sizes = (Sk, Sk + 1) if q_offset is None else (top, top + 7)
        for size in sizes:
            np.testing.assert_array_equal(
                dense_of(M.sliding_window(size), Sq, Sk, q_offset=q_offset),
                dense_of(M.causal(), Sq, Sk, q_offset=q_offset),
            )
        diag = (np.arange(Sq)[:, None] + off) == np.arange(Sk)[None, :]
        np.testing.assert_array_equal(
            dense_of(M.sliding_window(1), Sq, Sk, q_offset=q_offset)[0, 0], diag
        )


def test_sliding_window_counts_own_token():
    # size=3 at position 5 sees keys 3, 4, 5 (the Mistral / transformers convention)
    row = dense_of(M.sliding_window(3), 1, 8, q_offset=5)[0, 0, 0]
    assert np.flatnonzero(row).tolist() == [3, 4, 5]


def test_render_pictures():
    assert M.causal().render(3) == "█··\n██·\n███"
    pic = M.sliding_window(2).render(4, 6, q_offset=1)
    lines = pic.split("\n")
    assert len(lines) == 4 and all(len(line) == 6 for line in lines)
    assert set(pic) <= {"█", "·", "\n"}
    assert lines[0] == "██····"
    # render picks batch b / head h of per-batch and per-head masks
    assert M.padding([1, 3]).render(2, 4, b=1) == "███·\n███·"
    layout = torch.tensor([[[True, False]], [[False, True]]])  # (H=2, nQ=1, nK=2)
    assert M.block_sparse(layout, 2).render(1, 4, q_offset=0, h=1) == "··██"
    with pytest.raises(ValueError, match="B=3"):
        M.padding([1, 3]).render(2, 4, b=2)


# ----------------------------------------------------------------------------------------------
# Algebra
# ----------------------------------------------------------------------------------------------


def test_algebra_with_tensors_and_callables_on_either_side():
    Sq, Sk = 5, 7
    rng = np.random.default_rng(1)
    t = rng.random((Sq, Sk)) < 0.5
    tt = torch.tensor(t)

    def fn(b, h, q, kv):
        return (q + kv) % 3 != 0

    fn_np = (np.arange(Sq)[:, None] + (Sk - Sq) + np.arange(Sk)[None, :]) % 3 != 0
    caus = dense_of(M.causal(), Sq, Sk)[0, 0]
    win = dense_of(M.sliding_window(2), Sq, Sk)[0, 0]
    cases = {
        "mask & tensor": (M.causal() & tt, caus & t),
        "tensor & mask": (tt & M.causal(), t & caus),
        "mask | tensor": (M.causal() | tt, caus | t),
        "tensor | mask": (tt | M.causal(), t | caus),
        "mask & fn": (M.causal() & fn, caus & fn_np),
        "fn & mask": (fn & M.causal(), fn_np & caus),
        "fn | mask": (fn | M.sliding_window(2), fn_np | win),
        "~mask": (~M.causal(), ~caus),
        "~(mask | fn) & tensor": (~(M.sliding_window(2) | fn) & tt, ~(win | fn_np) & t),
    }
    for name, (m, want) in cases.items():
        assert isinstance(m, M.Mask), name
        np.testing.assert_array_equal(dense_of(m, Sq, Sk)[0, 0], want, err_msg=name)
    assert repr(M.causal() & ~M.sliding_window(3)) == "(causal() & ~sliding_window(3))"


def test_as_mask_normalises():
    assert isinstance(M.as_mask(M.causal()), M.Causal)
    assert isinstance(M.as_mask(torch.ones(2, 2, dtype=torch.bool)), M.TensorMask)
    assert isinstance(M.as_mask(lambda b, h, q, kv: q >= kv), M.CallableMask)
    fn = lambda b, h, q, kv: q >= kv  # noqa: E731
    assert M.as_mask(fn).as_mask_mod() is fn  # FlexAttention gets the user's function back


# ----------------------------------------------------------------------------------------------
# Random expression trees: tile classification is sound, and tight for leaves (hypothesis)
# ----------------------------------------------------------------------------------------------


def _callable_mask(kind: int):
    """A user mask_mod and its numpy twin (absolute positions, per head)."""
    if kind == 0:

        def fn(b, h, q, kv):
            return (q * 7 + kv * 3 + h) % 5 != 0

        return fn, lambda b, h, i, j: (i * 7 + j * 3 + h) % 5 != 0

    def fn2(b, h, q, kv):  # broadcasts; varies by batch
        return (kv - q).abs() <= b + 1

    return fn2, lambda b, h, i, j: np.abs(j - i) <= b + 1


@st.composite
def scenarios(draw):
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Sq, Sk = draw(st.integers(1, 80)), draw(st.integers(1, 80))
    q_offset = draw(st.one_of(st.just(Sk - Sq), st.integers(-20, 100)))
    kv_offset = draw(st.sampled_from([0, 0, 0, draw(st.integers(1, 30))]))
    bq, bk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    return dict(B=B, H=H, Sq=Sq, Sk=Sk, q_offset=q_offset, kv_offset=kv_offset, bq=bq, bk=bk)


LEAF_KINDS = [
    "causal",
    "window",
    "chunked",
    "padding",
    "prefix",
    "documents",
    "block_sparse",
    "tensor",
    "callable",
]


def tile_edges(sc) -> tuple[list[int], list[int]]:
    """First and last absolute positions of every query tile and every key tile."""
    qo, ko, bq, bk, Sq, Sk = (sc[k] for k in ("q_offset", "kv_offset", "bq", "bk", "Sq", "Sk"))
    q = [qo + r for t in range(0, Sq, bq) for r in (t, min(t + bq, Sq) - 1)]
    k = [ko + c for u in range(0, Sk, bk) for c in (u, min(u + bk, Sk) - 1)]
    return q, k


def pick(rng, lo: int, hi: int, interesting: list[int], size=None):
    """Uniform in [lo, hi], or (half the time) one of the interesting values clipped into it: tile
    rules are most often wrong exactly at a tile edge."""
    cand = [x for x in interesting if lo <= x <= hi] or [lo]
    n = 1 if size is None else size
    out = np.where(rng.random(n) < 0.5, rng.choice(cand, n), rng.integers(lo, hi + 1, n))
    return int(out[0]) if size is None else out


@st.composite
def leaves(draw, sc):
    B, H, Sq, Sk = sc["B"], sc["H"], sc["Sq"], sc["Sk"]
    qo, ko = sc["q_offset"], sc["kv_offset"]
    # ids and block layouts exist only for positions >= 0
    kinds = (
        LEAF_KINDS if qo >= 0 else [k for k in LEAF_KINDS if k not in ("documents", "block_sparse")]
    )
    kind = draw(st.sampled_from(kinds))
    q_hi, k_hi = qo + Sq, ko + Sk  # one past the last absolute position
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    q_edges, k_edges = tile_edges(sc)
    k_near = [e + d for e in k_edges for d in (0, 1)]
    if kind == "causal":
        return M.causal(), f_causal()
    if kind == "window":
        # i - j over a tile spans [qf - kl, ql - kf]: sizes at those ends decide FULL / EMPTY
        w = pick(rng, 1, 90, [qe - ke + d for qe in q_edges for ke in k_edges for d in (0, 1)])
        return M.sliding_window(w), f_window(w)
    if kind == "chunked":
        s, c = draw(st.integers(1, 40)), draw(st.booleans())
        return M.chunked(s, causal=c), f_chunked(s, causal=c)
    if kind == "padding":
        per_batch = draw(st.booleans())
        n = pick(rng, 0, k_hi, k_near, size=B if per_batch else None)
        return M.padding(torch.tensor(n)), f_padding(n)
    if kind == "prefix":
        per_batch = draw(st.booleans())
        hi = max(k_hi, q_hi) + 2
        near = k_near + [e + 1 for e in q_edges]
        n = pick(rng, 0, hi, near, size=B if per_batch else None)
        return M.prefix_lm(n.tolist() if per_batch else n), f_prefix(n)
    if kind == "documents":
        S = max(q_hi, k_hi) + int(rng.integers(0, 5))
        n_docs = int(rng.integers(1, 6))
        shape = (B, S) if draw(st.booleans()) else (S,)
        ids = rng.integers(0, n_docs, size=shape)
        if draw(st.booleans()):
            ids = np.sort(ids, axis=-1)  # the packed case
        return M.documents(torch.tensor(ids, dtype=torch.int32)), f_documents(ids)
    if kind == "block_sparse":
        bq, bk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        nq, nk = -(-max(q_hi, 1) // bq), -(-k_hi // bk)
        lead = draw(st.sampled_from([(), (H,), (1, H), (B, H), (B, 1)]))
        layout = rng.random((*lead, nq, nk)) < draw(st.sampled_from([0.2, 0.5, 0.9]))
        return M.block_sparse(torch.tensor(layout), (bq, bk)), f_block_sparse(layout, bq, bk)
    if kind == "tensor":
        shape = (
            draw(st.sampled_from([1, B])),
            draw(st.sampled_from([1, H])),
            draw(st.sampled_from([1, Sq])),
            draw(st.sampled_from([1, k_hi])),  # columns are key positions
        )
        t = rng.random(shape) < draw(st.sampled_from([0.1, 0.5, 0.95]))
        return M.from_tensor(torch.tensor(t)), f_tensor(t, qo)
    fn, f = _callable_mask(draw(st.integers(0, 1)))
    return M.CallableMask(fn), f


@st.composite
def trees(draw, sc, depth):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(leaves(sc))
    op = draw(st.sampled_from(["and", "or", "not"]))
    a, fa = draw(trees(sc, depth - 1))
    if op == "not":
        return ~a, lambda b, h, i, j: ~fa(b, h, i, j)
    c, fc = draw(trees(sc, depth - 1))
    if op == "and":
        return a & c, lambda b, h, i, j: fa(b, h, i, j) & fc(b, h, i, j)
    return a | c, lambda b, h, i, j: fa(b, h, i, j) | fc(b, h, i, j)


def _check_tiles(mask, f, sc, exact: bool):
    B, H, Sq, Sk = sc["B"], sc["H"], sc["Sq"], sc["Sk"]
    qo, ko, bq, bk = sc["q_offset"], sc["kv_offset"], sc["bq"], sc["bk"]
    dense = truth(f, B, H, Sq, Sk, qo, ko)
    if ko == 0 and isinstance(mask, M.Mask):
        got = mask.to_dense(Sq, Sk, B=B, H=H, q_offset=qo).numpy()
        np.testing.assert_array_equal(got, dense, err_msg=f"to_dense of {mask!r}")
    grid = TileGrid(Sq, Sk, bq, bk, q_offset=qo, kv_offset=ko)
    kinds = mask.tile_kinds(grid, B, H)
    assert kinds.dtype == torch.int8
    kinds = kinds.expand(B, H, grid.n_q, grid.n_k).numpy()
    want = tile_truth(dense, bq, bk)
    where = f"{mask!r} grid={grid}"
    assert not ((kinds == EMPTY) & (want != EMPTY)).any(), (
        f"EMPTY tile with an attending pair: {where}"
    )
    assert not ((kinds == FULL) & (want != FULL)).any(), f"FULL tile with a masked pair: {where}"
    if exact:
        np.testing.assert_array_equal(kinds, want, err_msg=f"not tight: {where}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tile_kinds_sound_for_random_expressions(data):
    sc = data.draw(scenarios())
    mask, f = data.draw(trees(sc, 3))
    _check_tiles(mask, f, sc, exact=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tile_kinds_exact_for_leaves(data):
    sc = data.draw(scenarios())
    mask, f = data.draw(leaves(sc))
    _check_tiles(mask, f, sc, exact=True)
    # ~ swaps EMPTY and FULL, so it is exact on a leaf too
    _check_tiles(~mask, lambda b, h, i, j: ~f(b, h, i, j), sc, exact=True)


# ----------------------------------------------------------------------------------------------
# What consumers ask of a mask (key interval, relative, causal, analytic, row order), each
# answer checked against the elementwise truth of the formulas above (hypothesis)
# ----------------------------------------------------------------------------------------------

INTERVAL_LEAVES = {"causal", "window", "chunked", "padding", "prefix"}


def _check_key_interval(mask, f, sc):
    """``key_interval`` is exact where it answers: key j attends iff lo <= j < hi, every head."""
    B, H, Sq, Sk, qo, ko = (sc[k] for k in ("B", "H", "Sq", "Sk", "q_offset", "kv_offset"))
    b = torch.arange(B).view(B, 1)
    q = (torch.arange(Sq) + qo).view(1, Sq)
    got = mask.key_interval(b, q)
    assert (got is not None) == mask.is_interval, f"is_interval disagrees for {mask!r}"
    if got is None:
        return
    lo, hi = (torch.broadcast_to(x, (B, Sq)).numpy() for x in got)
    j = (np.arange(Sk) + ko).reshape(1, 1, 1, Sk)
    want = truth(f, B, H, Sq, Sk, qo, ko)
    inside = (lo[:, None, :, None] <= j) & (j < hi[:, None, :, None])  # (B, 1, Sq, Sk)
    np.testing.assert_array_equal(
        np.broadcast_to(inside, want.shape), want, err_msg=f"key_interval of {mask!r} sc={sc}"
    )


@st.composite
def interval_trees(draw, sc):
    """``&`` of one to three leaves that are one key interval per row (causal if none drawn)."""
    drawn = [draw(leaves(sc)) for _ in range(draw(st.integers(1, 3)))]
    parts = [p for p in drawn if p[0].is_interval] or [(M.causal(), f_causal())]
    mask = parts[0][0]
    for m, _ in parts[1:]:
        mask = mask & m
    fs = [f for _, f in parts]
    return mask, lambda b, h, i, j: functools.reduce(np.logical_and, (f(b, h, i, j) for f in fs))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_key_interval_matches_elementwise_truth(data):
    sc = data.draw(scenarios())
    mask, f = data.draw(interval_trees(sc))
    assert mask.is_interval, repr(mask)
    _check_key_interval(mask, f, sc)
    mask, f = data.draw(trees(sc, 3))  # any tree: exact where it answers, None otherwise
    _check_key_interval(mask, f, sc)


def test_key_interval_leaves_and_combinators():
    """Which masks are intervals: the five interval leaves and their &; | and ~ are not."""
    leaves_ = [M.causal(), M.sliding_window(3), M.chunked(4), M.padding([2, 5]), M.prefix_lm(3)]
    assert all(m.is_interval for m in leaves_)
    assert (M.causal() & M.padding([2, 5]) & M.chunked(3, causal=False)).is_interval
    others = [
        M.documents(torch.arange(8)),
        M.block_sparse(torch.ones(2, 2, dtype=torch.bool), 4),
        M.from_tensor(torch.ones(3, 3, dtype=torch.bool)),
        M.CallableMask(lambda b, h, q, kv: kv <= q),
        M.causal() | M.sliding_window(2),
        ~M.causal(),
        M.causal() & M.documents(torch.arange(8)),
    ]
    for m in others:
        assert not m.is_interval, repr(m)
        assert m.key_interval(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3)) is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), shift=st.integers(-40, 40))
def test_relative_and_causal_claims_hold_elementwise(data, shift):
    """A mask that says it is relative gives the same matrix when queries and keys move by the
    same amount, for every (b, h); one that says it is causal is exactly j <= i."""
    sc = data.draw(scenarios())
    mask, f = data.draw(trees(sc, 3))
    B, H, Sq, Sk, qo, ko = (sc[k] for k in ("B", "H", "Sq", "Sk", "q_offset", "kv_offset"))
    want = truth(f, B, H, Sq, Sk, qo, ko)
    if mask.relative:
        moved = truth(f, B, H, Sq, Sk, qo + shift, ko + shift)
        np.testing.assert_array_equal(moved, want, err_msg=f"{mask!r} is not relative")
        np.testing.assert_array_equal(want, np.broadcast_to(want[:1, :1], want.shape))
    if mask.is_causal:
        np.testing.assert_array_equal(
            want, np.broadcast_to(truth(f_causal(), B, H, Sq, Sk, qo, ko), want.shape)
        )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_shifted_mask_is_the_mask_at_moved_keys_and_rows(data):
    """``mask.shifted(kv, batch=s)`` for a call whose key column c sits at position
    ``kv_offset + c + kv`` and whose batch row b is the mask's row ``b + s``: tile kinds (sound),
    dense form and key intervals agree with the formula at the moved positions."""
    sc = data.draw(scenarios())
    mask, f = data.draw(trees(sc, 2))
    kv = data.draw(st.integers(-20, 30))
    batch = data.draw(st.integers(0, sc["B"] - 1))
    moved = dict(sc, B=sc["B"] - batch, kv_offset=sc["kv_offset"] - kv)
    shifted = mask.shifted(kv, batch=batch)
    assert shifted.analytic == mask.analytic and shifted.row_ordered == mask.row_ordered

    def g(b, h, i, j):  # rows batch.. of the mask's whole batch (some formulas ignore b)
        every = np.arange(sc["B"]).reshape(-1, 1, 1, 1)
        out = f(every, h, i, j + kv)
        out = np.broadcast_to(out, np.broadcast_shapes(out.shape, every.shape))
        return out[batch : batch + b.shape[0]]

    _check_tiles(shifted, g, moved, exact=False)
    _check_key_interval(shifted, g, moved)


def test_bind_anchors_row_ordered_tensors_only():
    """bind(q_offset) puts row i of a from_tensor mask at position q_offset + i (one offset per
    sequence with a tensor), leaves every other mask as it is, and binds once."""
    g = torch.Generator().manual_seed(5)
    t = torch.rand(2, 1, 3, 7, generator=g) > 0.5
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    kv = torch.arange(7).view(1, 1, 1, 7)
    q = (torch.arange(3) + 4).view(1, 1, 3, 1)  # rows 0..2 at positions 4..6
    cau = M.causal()
    bound = (cau & M.from_tensor(t)).bind(4)
    assert torch.equal(bound.mask_mod(b, h, q, kv), t & (kv <= q))
    assert bound.bind(9) is bound and cau.bind(4) is cau and bound.is_causal is False
    per_seq = M.from_tensor(t).bind(torch.tensor([4, 1]))  # sequence 1's rows at 1..3
    q1 = (torch.arange(3) + 1).view(1, 1, 3, 1)
    assert torch.equal(per_seq.mask_mod(b[1:], h, q1, kv), t[1:])
    assert torch.equal(per_seq.mask_mod(b[:1], h, q, kv), t[:1])
    # unbound, a row-ordered tensor cannot say which row a position is
    with pytest.raises(RuntimeError, match=r"read by query row.*\.bind\(q_offset\)"):
        M.from_tensor(t).mask_mod(b, h, q, kv)
    # bound to global rows (a ring block reads its slice); rows past the tensor name the fix
    glob = M.from_tensor(t).bind(0)
    glob.validate(2, 1, 2, 7, 1)
    with pytest.raises(ValueError, match=r"no rows 2\.\.3 .* query positions 2\.\.3"):
        glob.validate(2, 1, 2, 7, 2)


def test_shifted_keeps_what_consumers_ask():
    """A shifted mask keeps analytic tiles, relative and interval answers; causal only unshifted."""
    cau, win = M.causal(), M.sliding_window(3)
    assert cau.shifted(0, batch=1).is_causal and not cau.shifted(2).is_causal
    assert win.shifted(5).relative and win.shifted(5).analytic and win.shifted(5).is_interval
    assert not M.documents(torch.arange(9)).shifted(2).is_interval
    assert repr(win.shifted(5, batch=1)) == "sliding_window(3).shifted(kv=5, batch=1)"
    with pytest.raises(ValueError, match="shifted batch must be"):
        cau.shifted(0, batch=-1)


def test_questions_compose_through_and_or_not():
    """Leaves answer for themselves; &, | and ~ answer from their parts."""
    cau, win, chk = M.causal(), M.sliding_window(3), M.chunked(4)
    t = M.from_tensor(torch.ones(3, 3, dtype=torch.bool))
    fn = M.CallableMask(lambda b, h, q, kv: kv <= q)
    assert cau.relative and win.relative and not chk.relative and not M.padding(2).relative
    assert (cau & ~win).relative and (cau | win).relative and not (cau & chk).relative
    assert cau.is_causal and (cau & cau).is_causal and (cau | cau).is_causal
    assert not (~cau).is_causal and not (cau & win).is_causal and not win.is_causal
    assert cau.analytic and (~(cau | chk) & M.documents(torch.arange(9))).analytic
    assert not t.analytic and not fn.analytic and not (cau & fn).analytic and not (~t).analytic
    assert t.row_ordered and (cau | ~t).row_ordered and not (cau & fn).row_ordered
    assert (cau & win).children() == (cau, win) and (~cau).children() == (cau,)
    assert cau.children() == ()


def test_and_or_not_are_siblings():
    """Or is not a kind of And: a walker asking `isinstance(m, And)` of an Or would
    take a union for an intersection."""
    a, o, n = M.causal() & M.chunked(2), M.causal() | M.chunked(2), ~M.causal()
    assert not isinstance(o, type(a)) and not isinstance(a, type(o))
    assert not isinstance(n, type(a)) and not isinstance(n, type(o))
    assert not issubclass(type(o), type(a))
    for m in (a, o, n):
        assert isinstance(m, M.Mask)


# Mask classes no module outside selfattn/masks may name: the masks answer every question
# themselves, so a consumer never switches on what kind of mask it holds.
_MASK_CLASSES = frozenset(
    {
        "And", "Or", "Not", "Causal", "SlidingWindow", "Chunked", "Padding", "Documents",
        "PrefixLM", "BlockSparse", "TensorMask", "CallableMask",
    }
)  # fmt: skip


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_no_module_outside_masks_switches_on_mask_classes():
    """Walk src/selfattn: outside masks/, no isinstance/issubclass/`type(x) is` test and no
    import names a mask class."""
    root = Path(sa.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("masks/"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            hit: set[str] = set()
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "isinstance",
                "issubclass",
            ):
                hit = _names(node.args[1]) if len(node.args) > 1 else set()
            elif isinstance(node, ast.Compare) and any(
                isinstance(x, ast.Call) and getattr(x.func, "id", None) == "type"
                for x in (node.left, *node.comparators)
            ):
                hit = _names(node)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "selfattn.masks"
            ):
                hit = {a.name for a in node.names}
            for name in sorted(hit & _MASK_CLASSES):
                found.append(f"{rel}:{node.lineno} {name}")
    assert not found, "modules outside masks/ switching on mask classes:\n" + "\n".join(found)


def test_documents_unsorted_ids_are_exact():
    # q tile ids {0, 2} and key tile ids {1} overlap as intervals but share no document
    ids = torch.tensor([0, 2, 1, 1])
    m = M.documents(ids)
    grid = TileGrid(2, 2, 2, 2, q_offset=0, kv_offset=2)
    assert m.tile_kinds(grid).flatten().tolist() == [int(EMPTY)]


def test_callable_mask_tile_kinds_exact_and_vmap_fallback():
    # torch.stack needs equal shapes, so this only runs element by element (vmap)
    def not_broadcasting(b, h, q, kv):
        return torch.stack([q, kv]).amax(0) % 4 != 3

    m = M.CallableMask(not_broadcasting)
    Sq, Sk, qo = 9, 11, 1
    want = truth(lambda b, h, i, j: np.maximum(i, j) % 4 != 3, 1, 1, Sq, Sk, qo)
    np.testing.assert_array_equal(m.to_dense(Sq, Sk, q_offset=qo).numpy(), want)
    grid = TileGrid(Sq, Sk, 4, 3, q_offset=qo, kv_offset=0)
    np.testing.assert_array_equal(m.tile_kinds(grid).numpy(), tile_truth(want, 4, 3))


def test_tile_grid_ragged_and_offsets():
    g = TileGrid(Sq=10, Sk=7, block_q=4, block_k=3, q_offset=5, kv_offset=20)
    assert (g.n_q, g.n_k) == (3, 3)
    assert g.q_first().flatten().tolist() == [5, 9, 13]
    assert g.q_last().flatten().tolist() == [8, 12, 14]
    assert g.kv_first().flatten().tolist() == [20, 23, 26]
    assert g.kv_last().flatten().tolist() == [22, 25, 26]
    empty = TileGrid(0, 5, 4, 4)
    assert empty.n_q == 0 and M.causal().tile_kinds(empty).shape[-2:] == (0, 2)


def test_classify_one_tile():
    c = M.causal()
    assert c.classify((0, 2), (2, 4)) == EMPTY
    assert c.classify((4, 6), (0, 5)) == FULL
    assert c.classify((0, 4), (0, 4)) == PARTIAL
    # over all (b, h): full in batch 0, empty in batch 1 -> PARTIAL
    p = M.padding([4, 0])
    assert p.classify((0, 3), (0, 4), B=2) == PARTIAL
    assert M.padding([4, 4]).classify((0, 3), (0, 4), B=2) == FULL
    # a row-ordered tensor reads rows q_range - q_offset
    t = torch.tensor([[True, True], [False, False], [True, False]])
    m = M.from_tensor(t)
    assert m.classify((0, 1), (0, 2)) == FULL
    assert m.classify((11, 12), (0, 2), q_offset=10) == EMPTY
    assert m.classify((12, 13), (0, 1), q_offset=10) == FULL
    with pytest.raises(ValueError, match=r"rows 3\.\.3"):
        m.classify((3, 4), (0, 2))
    with pytest.raises(ValueError, match=r"q_range=\(3, 3\)"):
        c.classify((3, 3), (0, 2))


# ----------------------------------------------------------------------------------------------
# Inputs of other dtypes and devices, and attention through the reference backend
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_dtypes_of_lengths_and_ids(dtype):
    lengths = torch.tensor([2, 5], dtype=dtype)
    want = truth(f_padding([2, 5]), 2, 1, 3, 5, 2)
    np.testing.assert_array_equal(dense_of(M.padding(lengths), 3, 5, B=2), want)
    ids = torch.tensor([0, 0, 1, 1, 1], dtype=dtype)
    np.testing.assert_array_equal(
        dense_of(M.documents(ids), 5, 5), truth(f_documents(ids.long().numpy()), 1, 1, 5, 5, 0)
    )
    np.testing.assert_array_equal(
        dense_of(M.prefix_lm(lengths), 3, 5, B=2), truth(f_prefix([2, 5]), 2, 1, 3, 5, 2)
    )


def test_masks_through_reference_attention():
    torch.manual_seed(0)
    B, H, Sq, Sk, D = 2, 3, 5, 8, 4
    q, k, v = (torch.randn(B, H, s, D, dtype=torch.float64) for s in (Sq, Sk, Sk))
    lengths = torch.tensor([6, 3])
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 2, 2, 2]])
    # packed causal documents, plus key 0 as an attention sink (padding(1): keys j < 1)
    mask = (M.causal() & M.documents(ids)) | M.padding(1)
    mask = mask & M.padding(lengths)

    def not_broadcasting(b, h, q_idx, kv_idx):  # the same mask, only vmappable
        same = torch.stack([ids[b, q_idx], ids[b, kv_idx]]).diff(dim=0).squeeze(0) == 0
        return ((same & (kv_idx <= q_idx)) | (kv_idx < 1)) & (kv_idx < lengths[b])

    out = sa.attention(q, k, v, mask=mask, backend="reference")
    allowed = torch.from_numpy(dense_of(mask, Sq, Sk, B=B, H=H).copy())
    s = (q @ k.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v
    torch.testing.assert_close(out, want)
    out2 = sa.attention(q, k, v, mask=not_broadcasting, backend="reference")
    torch.testing.assert_close(out2, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_built_on_one_device_evaluated_on_another():
    lengths = torch.tensor([3, 5], device="cuda")
    ids = torch.tensor([0, 0, 1, 1, 1], device="cuda")
    mask = M.padding(lengths) & M.documents(ids) & M.causal()
    want = dense_of(mask, 4, 5, B=2)  # evaluated on the CPU
    got = mask.to_dense(4, 5, B=2, device="cuda").cpu().numpy()
    np.testing.assert_array_equal(got, want)
    grid = TileGrid(4, 5, 2, 2, q_offset=1, device="cuda")
    cpu = mask.tile_kinds(TileGrid(4, 5, 2, 2, q_offset=1)).expand(2, 1, 2, 3)
    torch.testing.assert_close(mask.tile_kinds(grid).expand(2, 1, 2, 3).cpu(), cpu)


# ----------------------------------------------------------------------------------------------
# Errors: each names the offending value
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size,exc,match",
    [
        (0, ValueError, r"got 0"),
        (-1, ValueError, r"got -1"),
        (2.5, TypeError, r"float 2\.5"),
        (True, TypeError, r"bool True"),
    ],
)
def test_window_size_errors(size, exc, match):
    with pytest.raises(exc, match=match):
        M.sliding_window(size)


def test_chunked_errors():
    with pytest.raises(ValueError, match=r"chunked size must be >= 1, got 0"):
        M.chunked(0)
    with pytest.raises(TypeError, match=r"'yes'"):
        M.chunked(4, causal="yes")


def test_padding_errors():
    with pytest.raises(ValueError, match=r"2 lengths \[1, 2\].*B=3"):
        M.padding([1, 2]).to_dense(4, 4, B=3)
    with pytest.raises(ValueError, match=r"\[3, 9\] exceed the key length Sk=4"):
        M.padding([3, 9]).to_dense(4, 4, B=2)
    with pytest.raises(ValueError, match=r"-2"):
        M.padding([1, -2])
    with pytest.raises(TypeError, match=r"float32 \(values \[1\.5, 2\.0\]\)"):
        M.padding(torch.tensor([1.5, 2.0]))
    with pytest.raises(TypeError, match=r"torch\.bool"):
        M.padding(torch.tensor([True]))
    with pytest.raises(ValueError, match=r"shape \(2, 1\)"):
        M.padding(torch.tensor([[1], [2]]))


def test_documents_errors():
    with pytest.raises(ValueError, match=r"shape \(1, 2, 3\)"):
        M.documents(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"positions 0\.\.3 but the call .* needs positions 0\.\.5"
    ):
        M.documents(torch.tensor([0, 0, 1, 1])).to_dense(6, 6)
    with pytest.raises(ValueError, match=r"needs positions -2\.\."):
        M.documents(torch.tensor([0, 0, 1, 1])).to_dense(3, 3, q_offset=-2)
    with pytest.raises(TypeError, match=r"float32"):
        M.documents(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"batch 2 .* B=3"):
        M.documents(torch.zeros(2, 4, dtype=torch.long)).to_dense(4, 4, B=3)
    with pytest.raises(ValueError, match=r"positions 0\.\.3 .* tile grid needs positions 2\.\.5"):
        M.documents(torch.tensor([0, 0, 1, 1])).tile_kinds(TileGrid(4, 4, 2, 2, q_offset=2))


def test_prefix_lm_errors():
    with pytest.raises(ValueError, match=r"got value -1"):
        M.prefix_lm(-1)
    with pytest.raises(ValueError, match=r"values \[2, -3\]"):
        M.prefix_lm(torch.tensor([2, -3]))
    with pytest.raises(ValueError, match=r"3 lengths \[1, 2, 3\] .* B=2"):
        M.prefix_lm([1, 2, 3]).to_dense(4, 4, B=2)
    with pytest.raises(TypeError, match=r"float64"):
        M.prefix_lm(torch.tensor([1.0], dtype=torch.float64))


def test_block_sparse_errors():
    with pytest.raises(TypeError, match=r"torch\.int64"):
        M.block_sparse(torch.ones(2, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"got shape \(4,\)"):
        M.block_sparse(torch.ones(4, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"got shape \(1, 1, 1, 2, 2\)"):
        M.block_sparse(torch.ones(1, 1, 1, 2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"2x2 blocks of 4x4 .* query positions 0\.\.8"):
        M.block_sparse(torch.ones(2, 2, dtype=torch.bool), 4).to_dense(9, 8, q_offset=0)
    with pytest.raises(ValueError, match=r"keys 0\.\.9"):
        M.block_sparse(torch.ones(3, 2, dtype=torch.bool), 4).to_dense(2, 10, q_offset=0)
    with pytest.raises(ValueError, match=r"\(1, 3, 2, 2\) does not broadcast .* Hq=4"):
        M.block_sparse(torch.ones(3, 2, 2, dtype=torch.bool), 4).to_dense(2, 2, H=4)
    with pytest.raises(ValueError, match=r"got 0"):
        M.block_sparse(torch.ones(2, 2, dtype=torch.bool), (4, 0))
    with pytest.raises(TypeError, match=r"\(1, 2, 3\)"):
        M.block_sparse(torch.ones(2, 2, dtype=torch.bool), (1, 2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_from_tensor_non_bool_says_use_score_mod(dtype):
    with pytest.raises(TypeError, match=rf"got {dtype}; pass additive float biases as score_mod="):
        M.from_tensor(torch.zeros(3, 3, dtype=dtype))


def test_tensor_mask_shape_errors():
    m = M.from_tensor(torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \(1, 2, 3, 4\) .* \(1, 4, 3, 4\)"):
        m.to_dense(3, 4, H=4)
    with pytest.raises(ValueError, match=r"5-D shape \(1, 1, 1, 3, 3\)"):
        M.from_tensor(torch.ones(1, 1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got list"):
        M.from_tensor([[True]])
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"shape \(1, 1, 3, 5\) .* = \(1, 2, 3, 3\)"):
        sa.attention(q, q, q, mask=torch.ones(3, 5, dtype=torch.bool), backend="reference")


def test_mask_mod_errors():
    with pytest.raises(TypeError, match=r"torch\.int64"):
        M.CallableMask(lambda b, h, q, kv: q - kv).to_dense(3, 3)
    with pytest.raises(TypeError, match=r"torch\.float32"):
        M.as_mask(lambda b, h, q, kv: (q >= kv).float()).to_dense(3, 3)

    def five(score, b, h, q, kv):
        return score

    with pytest.raises(TypeError, match=r"five\(score, b, h, q, kv\) .* score_mod="):
        M.as_mask(five)

    def python_if(b, h, q, kv):
        return q >= kv if q > 2 else q < kv  # data-dependent control flow: neither path works

    with pytest.raises(ValueError, match=r"python_if failed: .*\(torch\.where"):
        M.as_mask(python_if).to_dense(4, 4)

    def per_element_vector(b, h, q, kv):
        return (q.reshape(-1) >= kv.reshape(-1)).repeat(2)

    with pytest.raises(ValueError, match=r"per_element_vector returned \(1, 1, 3, 3, 2\)"):
        M.as_mask(per_element_vector).to_dense(3, 3)
    with pytest.raises(TypeError, match=r"got str"):
        M.as_mask("causal")
    with pytest.raises(TypeError, match=r"got str"):
        M.causal() & "causal"


def test_tile_grid_and_to_dense_errors():
    with pytest.raises(ValueError, match=r"block_q must be >= 1, got 0"):
        TileGrid(4, 4, 0, 2)
    with pytest.raises(ValueError, match=r"Sk must be >= 0, got -1"):
        TileGrid(4, -1, 2, 2)
    with pytest.raises(TypeError, match=r"float 1\.5"):
        TileGrid(4, 4, 2, 2, q_offset=1.5)
    with pytest.raises(ValueError, match=r"Sq must be >= 0, got -2"):
        M.causal().to_dense(-2, 3)


@pytest.mark.parametrize(
    "Sq,Sk,bq,bk,qo", [(97, 61, 8, 7, 3), (130, 77, 16, 5, -4), (1, 50, 4, 4, 49)]
)
def test_elementwise_fallback_in_bands_equals_one_shot(monkeypatch, Sq, Sk, bq, bk, qo):
    """The fallback evaluates long grids in bands of whole query tiles (bounded memory)."""
    callable_mask = M.CallableMask(lambda b, h, q, kv: ((q * 7 + kv * 3 + h) % 5 != 0) & (kv <= q))
    tensor_mask = M.from_tensor(
        torch.rand(2, 1, Sq, Sk, generator=torch.Generator().manual_seed(Sq)) > 0.5
    )
    grid = M.TileGrid(Sq, Sk, bq, bk, q_offset=qo)
    for mask in (callable_mask, tensor_mask):
        monkeypatch.setattr(M.tiles, "_BAND_ELEMENTS", 1 << 40)
        one_shot = mask.tile_kinds(grid, 2, 3)
        monkeypatch.setattr(M.tiles, "_BAND_ELEMENTS", 50)  # forces one band per query tile
        banded = mask.tile_kinds(grid, 2, 3)
        assert torch.equal(one_shot.expand(2, 3, -1, -1), banded.expand(2, 3, -1, -1))


def test_kernel_form_is_an_interval_and_document_ids_or_none():
    """What a kernel reads as data (the Triton backend): a mask that is one key interval per
    row, and/or one set of document ids, and that form agrees with the mask elementwise."""
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = M.causal() & M.documents(ids) & M.sliding_window(3)
    interval, got_ids = mask.kernel_form()
    assert torch.equal(got_ids, ids.view(1, 9)) and interval.is_interval  # (B or 1, S)
    b, q = torch.zeros(1, 1, dtype=torch.long), torch.arange(9).view(1, 9)
    lo, hi = interval.key_interval(b, q)
    j = torch.arange(9).view(1, 1, 9)
    rebuilt = (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1)) & (ids[q].unsqueeze(-1) == ids[j])
    assert torch.equal(rebuilt[0], mask.to_dense(9, 9)[0, 0])
    none_interval, doc_ids = M.documents(ids).kernel_form()
    assert none_interval is None and torch.equal(doc_ids, ids.view(1, 9))
    assert M.padding(4).kernel_form()[0] is not None
    for none in (M.causal() | M.padding(2), ~M.causal(), M.documents(ids) & M.documents(ids),
                 M.as_mask(lambda b, h, qi, ki: qi >= ki)):  # fmt: skip
        assert none.kernel_form() is None, none
