"""Ragged compaction of the paged KV (PagedKV.compact with per-(layer, KV head) counts): each
layer's and head's hole skipped by every paged path.

Oracle: attention of each query head over exactly its kv head's kept keys and the new ones, in
float64, by the ratio rule against the same formula in float32; for packed steps of decode rows
(the C kernel or the PyTorch path) and long chunks (dense attention over gathered keys), uniform
steps, forks, trims and the page accounting.
"""

from __future__ import annotations

import pytest
import torch

from selfattn import masks
from selfattn.cache import PagedKV
from selfattn.testing import assert_close_to_reference

L, P, Hq, Hkv, D = 2, 4, 6, 3, 16
G = Hq // Hkv

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":  # the C kernel off: the PyTorch fallback
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    return request.param


def filled(kv: PagedKV, T: int, g: torch.Generator):
    """A new sequence of ``T`` random tokens in every layer; returns its id and dense K/V
    ``(L, Hkv, T, D)`` each."""
    s = kv.add_sequence()
    plan = kv.plan([s], T)
    k, v = torch.randn(2, L, Hkv, T, D, generator=g)
    for layer in range(L):
        kv.write(layer, plan, k[layer][None], v[layer][None])
    return s, k, v


def ragged(T: int, n_max: int, g: torch.Generator):
    """``(kept (L, Hkv, n_max), counts (L, Hkv))``: random ascending tokens per head, counts
    from 0 to ``n_max`` (one head at each end), padding past each count."""
    counts = torch.randint(0, n_max + 1, (L, Hkv), generator=g)
    counts[0, 0], counts[-1, -1] = n_max, 0
    kept = torch.zeros(L, Hkv, n_max, dtype=torch.long)
    for layer in range(L):
        for h in range(Hkv):
            c = int(counts[layer, h])
            kept[layer, h, :c] = torch.randperm(T, generator=g)[:c].sort().values
    return kept, counts


def oracle(q, keys, values, n_new, dtype):
    """``q (Hq, n_new, D)`` over ``keys``/``values``: a list per query head of ``(n, D)``, the
    last ``n_new`` of them the queries' own (causal among them), in ``dtype``."""
    out = []
    for h in range(Hq):
        k, v = keys[h].to(dtype), values[h].to(dtype)
        s = q[h].to(dtype) @ k.T * D**-0.5  # (n_new, n)
        n = k.shape[0]
        mask = torch.arange(n) > (n - n_new + torch.arange(n_new)).unsqueeze(1)
        out.append(torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v)
    return torch.stack(out)  # (Hq, n_new, D)


@pytest.mark.parametrize("chunk", [1, 3, 21], ids=["decode", "rows", "long-chunk"])
def test_each_head_attends_its_kept_keys_and_the_new_ones(path, chunk):
    """A packed step of a ragged sequence (``chunk`` new tokens: a decode row, rows of one
    call, a long chunk over its gathered keys) beside a whole one, every layer: each query
    head attends exactly its kv head's kept keys, then the new ones."""
    g = torch.Generator().manual_seed(chunk)
    kv = PagedKV(L, 40, P, Hkv, D, max_seqs=4, max_pages_per_seq=16)
    T, n_max = 23, 9
    s, k0, v0 = filled(kv, T, g)
    w, _, _ = filled(kv, 7, g)  # an uncompacted neighbour (no holes) in the same step
    kept, counts = ragged(T, n_max, g)
    assert kv.compact(s, kept, counts) == (T - n_max, -(-T // P) - -(-n_max // P))
    kv.check()
    step = kv.plan_packed([s, w], [chunk, 1])
    assert step.positions.view(-1)[:chunk].tolist() == list(range(T, T + chunk))
    n = chunk + 1
    for layer in range(L):
        q = torch.randn(1, Hq, n, D, generator=g)
        k, v = torch.randn(2, 1, Hkv, n, D, generator=g)
        out = step.layers[layer].attend(q, k, v, mask=masks.causal())  # (1, Hq, n, D)
        keys, values = [], []
        for h in range(Hq):
            mine = kept[layer, h // G, : counts[layer, h // G]]
            keys.append(torch.cat((k0[layer, h // G, mine], k[0, h // G, :chunk])))
            values.append(torch.cat((v0[layer, h // G, mine], v[0, h // G, :chunk])))
        q_s = q[0, :, :chunk]
        o64 = oracle(q_s, keys, values, chunk, torch.float64)
        naive = oracle(q_s, keys, values, chunk, torch.float32)
        assert_close_to_reference(out[0, :, :chunk], o64, naive, dtype=torch.float32)
    kv.free(s)
    kv.free(w)
    kv.check()
    assert kv.pool.num_free == kv.num_pages


def test_uniform_steps_forks_and_trims_keep_the_holes(path):
    """A uniform step over a ragged sequence and its fork (sharing pages and holes; the fork's
    write copies the shared page first), a trim past the holes; every page back at the end."""
    g = torch.Generator().manual_seed(5)
    kv = PagedKV(L, 30, P, Hkv, D, max_seqs=4, max_pages_per_seq=12)
    T, n_max = 17, 6
    s, k0, v0 = filled(kv, T, g)
    kept, counts = ragged(T, n_max, g)
    kv.compact(s, kept, counts)
    f = kv.fork(s)
    assert torch.equal(kv.blocks.holes(f), kv.blocks.holes(s))
    holes = kv.blocks.holes(s)
    assert holes[..., 0].tolist() == counts.tolist() and bool((holes[..., 1] == n_max).all())
    view = kv.view([s, f])
    step = view.plan(1)
    for layer in range(L):
        q = torch.randn(2, Hq, 1, D, generator=g)
        k, v = torch.randn(2, 2, Hkv, 1, D, generator=g)
        out = step.layers[layer].attend(q, k, v, mask=masks.causal())
        for b in range(2):
            keys = [torch.cat((k0[layer, h // G, kept[layer, h // G, : counts[layer, h // G]]],
                               k[b, h // G])) for h in range(Hq)]  # fmt: skip
            values = [torch.cat((v0[layer, h // G, kept[layer, h // G, : counts[layer, h // G]]],
                                 v[b, h // G])) for h in range(Hq)]  # fmt: skip
            o64 = oracle(q[b], keys, values, 1, torch.float64)
            naive = oracle(q[b], keys, values, 1, torch.float32)
            assert_close_to_reference(out[b], o64, naive, dtype=torch.float32)
    kv.check()
    kv.trim(f, 4)  # inside the holes: they end where the sequence does
    assert int(kv.blocks.holes(f).max()) <= 4
    kv.truncate(s)
    assert kv.blocks.holes(s) is None
    kv.free(f)
    kv.free(s)
    kv.check()
    assert kv.pool.num_free == kv.num_pages


def test_ragged_compaction_refusals_name_the_value():
    kv = PagedKV(L, 16, P, Hkv, D, max_seqs=2, max_pages_per_seq=8)
    s, _, _ = filled(kv, 9, torch.Generator().manual_seed(1))
    kept, counts = ragged(9, 4, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"counts must be in 0..4"):
        kv.compact(s, kept, counts + 5)
    with pytest.raises(ValueError, match=r"counts must be \(L=2, Hkv=3\)"):
        kv.compact(s, kept, counts[0])
    kv.compact(s, kept, counts)
    with pytest.raises(ValueError, match="compacted to ragged counts already"):
        kv.compact(s, kept, counts)
    kv.free(s)
    kv.check()
