"""Masks and score mods take FlexAttention's signatures on absolute positions everywhere.

``mask_mod(b, h, q_idx, kv_idx)`` and ``score_mod(score, b, h, q_idx, kv_idx)``: ``q_idx`` is the
query's absolute position (row ``i`` of a call at ``q_offset + i``), ``kv_idx`` the key's. Tensors
given in query-row order (bool masks, bias tensors) are bound to those positions by the call
(``Mask.bind``), so no consumer passes ``q_offset`` to a mod. The oracles here are written out in
float64 from the formulas, independently of the library's mask machinery.
"""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

import selfattn as sa
from selfattn import backends, masks, scores
from selfattn.cache import PagedCache, SlidingWindowCache, StaticCache, paged_attention
from selfattn.call import prepare
from selfattn.nn import MultiHeadAttention
from selfattn.testing import assert_close_to_reference, make_qkv

# -- the float64 oracle, by hand ------------------------------------------------------------------


def _user_mask(b, h, q_idx, kv_idx):
    """A user mask on absolute positions that no row offset could fake: it depends on q_idx
    itself, not only on q_idx - kv_idx."""
    return ((q_idx * 7 + kv_idx * 3 + h) % 5) != 0


def _user_score(score, b, h, q_idx, kv_idx):
    return score + 0.05 * (q_idx - 2 * kv_idx)


def _positions(Sq, Sk, q_offset):
    qpos = (torch.arange(Sq) + q_offset).view(1, 1, Sq, 1)
    kpos = torch.arange(Sk).view(1, 1, 1, Sk)
    return qpos, kpos


def _oracle(q, k, v, allowed, bias, scale, dtype):
    """Softmax attention written out in ``dtype``: ``allowed`` bool and ``bias`` float, both
    broadcastable to ``(B, Hq, Sq, Sk)``; a row with no allowed key gives 0."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale + bias.to(dtype)
    s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    total = p.sum(-1, keepdim=True)
    return (p / torch.where(total == 0, 1.0, total)) @ v


def _rejection(backend, q, k, v, **kw):
    qq, kk, vv, call = prepare(q, k, v, **kw)
    return backends.get(backend).reject(qq, kk, vv, call)


# (Sq, Sk, q_offset): a decode step, a chunk after a cached prefix (bottom-right), and queries
# placed explicitly past the keys
CASES = {"decode": (1, 37, None), "chunk": (5, 29, None), "q_offset": (7, 9, 11)}


@pytest.mark.parametrize("mods", ["tensors", "tensors+callables"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa"])
def test_user_mods_and_row_tensors_see_absolute_positions(backend, case, mods):
    """A bool tensor and a bias tensor (query-row order) with user callables (absolute
    positions) under Sq < Sk and an explicit q_offset: the callables see exactly the call's
    positions, and the result equals the float64 oracle by the ratio rule."""
    Sq, Sk, q_offset = CASES[case]
    off = Sk - Sq if q_offset is None else q_offset
    B, Hq, Hkv, D = 2, 4, 2, 16
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, seed=len(case) * 10 + len(mods))
    g = torch.Generator().manual_seed(Sq * 100 + Sk)
    rows = torch.rand(B, 1, Sq, Sk, generator=g) > 0.2  # row i = the call's query row i
    table = torch.randn(1, Hq, Sq, Sk, generator=g, dtype=torch.float64)
    seen = []

    def recording_mask(b, h, q_idx, kv_idx):
        seen.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return _user_mask(b, h, q_idx, kv_idx)

    mask, score_mod = masks.from_tensor(rows), scores.bias(table)
    # sdpa adds float masks only: the callable score mod (not additive) is for the others
    score_callable = mods == "tensors+callables" and backend != "sdpa"
    if mods == "tensors+callables":
        mask = mask & recording_mask
    if score_callable:
        score_mod = score_mod >> _user_score
    kw = dict(mask=mask, score_mod=score_mod, q_offset=q_offset)
    assert _rejection(backend, q, k, v, **kw) is None
    out = sa.attention(q, k, v, backend=backend, **kw)

    qpos, kpos = _positions(Sq, Sk, off)
    allowed, bias = rows, table
    if mods == "tensors+callables":
        allowed = allowed & _user_mask(0, torch.arange(Hq).view(1, Hq, 1, 1), qpos, kpos)
        assert seen, "the user's mask_mod was never called"
        lo_q, hi_q = min(s[0] for s in seen), max(s[1] for s in seen)
        lo_k, hi_k = min(s[2] for s in seen), max(s[3] for s in seen)
        assert (lo_q, hi_q) == (off, off + Sq - 1), f"q_idx seen {lo_q}..{hi_q}"
        assert (lo_k, hi_k) == (0, Sk - 1), f"kv_idx seen {lo_k}..{hi_k}"
    if score_callable:
        bias = bias + 0.05 * (qpos - 2 * kpos)
    scale = 1.0 / math.sqrt(D)
    want = _oracle(q, k, v, allowed, bias, scale, torch.float64)
    naive = _oracle(q, k, v, allowed, bias, scale, q.dtype)
    assert_close_to_reference(out, want, naive, what=f"{backend} {case} {mods}")


def test_flex_user_mods_and_row_tensors_see_absolute_positions():
    """The same on flex (compiled FlexAttention; CPU: forward only)."""
    from selfattn.backends import flex as flex_backend

    if flex_backend._api() is None or flex_backend._cpu_reason() is not None:
        pytest.skip("this torch / CPU cannot run FlexAttention")
    Sq, Sk, off = 5, 29, 24
    B, Hq, Hkv, D = 2, 4, 2, 16
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, seed=41)
    g = torch.Generator().manual_seed(41)
    rows = torch.rand(B, 1, Sq, Sk, generator=g) > 0.2
    table = torch.randn(1, Hq, Sq, Sk, generator=g, dtype=torch.float64)
    kw = dict(mask=masks.from_tensor(rows) & _user_mask, score_mod=scores.bias(table))
    assert _rejection("flex", q, k, v, **kw) is None
    with torch.no_grad():
        out = sa.attention(q, k, v, backend="flex", **kw)
    qpos, kpos = _positions(Sq, Sk, off)
    allowed = rows & _user_mask(0, torch.arange(Hq).view(1, Hq, 1, 1), qpos, kpos)
    scale = 1.0 / math.sqrt(D)
    want = _oracle(q, k, v, allowed, table, scale, torch.float64)
    naive = _oracle(q, k, v, allowed, table, scale, q.dtype)
    assert_close_to_reference(out, want, naive, what="flex")


# -- caches: decode steps see absolute positions ------------------------------------------------


def _mha(seed):
    g = torch.Generator().manual_seed(seed)
    m = MultiHeadAttention(12, 4, 2, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return m, g


@pytest.mark.parametrize("chunk", [1, 3])
def test_window_cache_decode_mods_see_absolute_positions(chunk):
    """Through a sliding-window cache that has wrapped (keys start past 0), a user mask_mod and
    score_mod get absolute query and key positions (the keys' true ones), and decoding equals
    the full forward."""
    m, g = _mha(7)
    B, S, W = 2, 14, 4
    x = torch.randn(B, S, 12, generator=g, dtype=torch.float64)
    seen = []

    def mask_mod(b, h, q_idx, kv_idx):
        seen.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return masks.sliding_window(W).mask_mod(b, h, q_idx, kv_idx) & _user_mask(
            b, h, q_idx, kv_idx
        )

    full = m(x, mask=mask_mod, score_mod=_user_score)
    cache = SlidingWindowCache(B, W, 2, 3, dtype=torch.float64)
    steps = [m(x[:, :5], mask=mask_mod, score_mod=_user_score, cache=cache)]
    for i in range(5, S, chunk):
        n = min(chunk, S - i)
        seen.clear()
        steps.append(m(x[:, i : i + n], mask=mask_mod, score_mod=_user_score, cache=cache))
        start = max(0, i - (W - 1))  # the ring keeps the last W - 1 keys before the new ones
        assert min(s[0] for s in seen) == i and max(s[1] for s in seen) == i + n - 1
        assert min(s[2] for s in seen) == start and max(s[3] for s in seen) == i + n - 1
    err = (torch.cat(steps, 1) - full).abs().max().item()
    assert err <= 1e-12, f"window cache decode differs from the full forward by {err:.3g}"


def test_paged_attention_reads_row_tensors_per_sequence():
    """A bool tensor mask and a bias tensor ``(B, Hq, Sq, max(seq_lens))`` are read per
    sequence: row i of sequence b is its query at ``seq_lens[b] - Sq + i``; ragged lengths."""
    B, Hq, Hkv, Sq, D, P = 3, 4, 2, 2, 8, 4
    lens = [9, 4, 13]
    g = torch.Generator().manual_seed(23)
    pages_per = [math.ceil(n / P) for n in lens]
    N = sum(pages_per) + 2
    k_pages = torch.randn(N, P, Hkv, D, generator=g, dtype=torch.float64).float()
    v_pages = torch.randn(N, P, Hkv, D, generator=g, dtype=torch.float64).float()
    perm = torch.randperm(N, generator=g).tolist()
    table = torch.full((B, max(pages_per)), -1, dtype=torch.int32)
    for b, n in enumerate(pages_per):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64).float()
    Sk = max(lens)
    rows = torch.rand(B, Hq, Sq, Sk, generator=g) > 0.25
    table_bias = torch.randn(B, 1, Sq, Sk, generator=g, dtype=torch.float64)
    out = paged_attention(
        q, k_pages, v_pages, table, seq_lens, mask=masks.from_tensor(rows) & _user_mask,
        score_mod=scores.bias(table_bias), backend="torch",
    )  # fmt: skip
    scale = 1.0 / math.sqrt(D)
    for b, n in enumerate(lens):
        ids = table[b, : pages_per[b]].long()
        kb = k_pages[ids].reshape(-1, Hkv, D)[:n].transpose(0, 1)[None]  # (1, Hkv, n, D)
        vb = v_pages[ids].reshape(-1, Hkv, D)[:n].transpose(0, 1)[None]
        qpos, kpos = _positions(Sq, n, n - Sq)
        allowed = rows[b : b + 1, :, :, :n] & _user_mask(
            b, torch.arange(Hq).view(1, -1, 1, 1), qpos, kpos
        )
        bias = table_bias[b : b + 1, :, :, :n]
        want = _oracle(q[b : b + 1], kb, vb, allowed, bias, scale, torch.float64)
        naive = _oracle(q[b : b + 1], kb, vb, allowed, bias, scale, torch.float32)
        assert_close_to_reference(out[b : b + 1], want, naive, what=f"sequence {b}")


def test_paged_layer_reads_each_sequence_of_a_row_tensor():
    """A one-layer paged cache over ragged sequences with a row-ordered bias: output and
    weights of each sequence equal the same layer over that sequence alone (a StaticCache),
    given its own batch row of the bias (weights are computed one sequence at a time, reading
    batch row b of the mask and bias: Mask.shifted(batch=b))."""
    m, g = _mha(3)
    cache = PagedCache(16, 4, 2, 3, max_seqs=2, max_pages_per_seq=8, dtype=torch.float64)
    a, b = cache.add_sequence(), cache.add_sequence()
    prefill = torch.randn(1, 6, 12, generator=g, dtype=torch.float64)
    m(prefill, mask=masks.causal(), cache=cache.view([a]))
    x = torch.randn(2, 2, 12, generator=g, dtype=torch.float64)
    bias = torch.randn(2, 4, 2, 8, generator=g, dtype=torch.float64)  # (B, Hq, Sq, max length)
    mask = masks.causal() & _user_mask
    out, w = m(x, mask=mask, score_mod=bias, cache=cache.view([a, b]), return_weights=True)
    for row, (history, n) in enumerate([(prefill, 8), (None, 2)]):
        static = StaticCache(1, 8, 2, 3, dtype=torch.float64)
        if history is not None:
            m(history, mask=masks.causal(), cache=static)
        want, w_want = m(
            x[row : row + 1], mask=mask, score_mod=bias[row : row + 1, :, :, :n], cache=static,
            return_weights=True,
        )  # fmt: skip
        torch.testing.assert_close(out[row : row + 1], want, rtol=0, atol=1e-12)
        torch.testing.assert_close(w[row : row + 1, :, :, :n], w_want, rtol=0, atol=1e-12)
        assert (w[row, :, :, n:] == 0).all()


# -- no q_offset plumbing is left ---------------------------------------------------------------


def test_mods_take_flexattention_signatures():
    """Every mask_mod / score_mod / bias defined in src/selfattn takes exactly FlexAttention's
    arguments: no q_offset parameter, for any mask or score mod (AST over the package)."""
    root = Path(sa.__file__).parent
    want = {
        "mask_mod": ["b", "h", "q_idx", "kv_idx"],
        "score_mod": ["score", "b", "h", "q_idx", "kv_idx"],
        "bias": ["b", "h", "q_idx", "kv_idx"],
        "as_mask_mod": [],
        "as_score_mod": ["mod"],  # the module-level normaliser takes the thing to normalise
    }
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name not in want:
                continue
            args = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg != "self"]
            if "q_offset" in args:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}{tuple(args)}")
    assert not found, "mods that still take q_offset:\n" + "\n".join(found)
    for cls in (masks.Mask, masks.CallableMask, masks.TensorMask):
        params = list(inspect.signature(cls.mask_mod).parameters)[1:]
        assert params == want["mask_mod"], (cls, params)
    for cls in (scores.ScoreMod, scores.CallableScoreMod, scores.RelativePositionBias):
        params = list(inspect.signature(cls.score_mod).parameters)[1:]
        assert params == want["score_mod"], (cls, params)


def test_position_wrappers_are_one_mask_method():
    """The per-consumer wrappers (cache keys from a start, per-sequence rows, one batch row, a
    ring block's keys) are gone: Mask.shifted / ScoreMod.shifted and bind serve them all."""
    import selfattn.cache.base as base
    import selfattn.cache.paged as paged
    import selfattn.distributed.blocks as blocks

    gone = {
        base: ["_KeysFromMask", "_KeysFromScoreMod"],
        paged: ["_RowsMask", "_RowsScoreMod", "_BatchRowMask", "_BatchRowScoreMod"],
        blocks: ["ShiftedMask", "ShiftedScoreMod"],
    }
    left = [f"{m.__name__}.{n}" for m, names in gone.items() for n in names if hasattr(m, n)]
    assert not left, f"wrapper classes still defined: {left}"
    for obj in (masks.causal(), scores.alibi(4)):
        assert callable(obj.shifted) and callable(obj.bind)
