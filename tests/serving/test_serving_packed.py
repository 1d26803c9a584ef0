"""What the engine needs from the cache and the models: packed steps (PagedKV.plan_packed),
quantised PagedKV pages, and logits_to_keep as a tensor of positions."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.cache import PagedKV, dequantize, quantize_fp8, quantize_int8  # noqa: E402
from selfattn.cache.paged import FP8_HEADROOM, PACKED_ROWS_MAX  # noqa: E402
from selfattn.cache.quant import FP8_MAX  # noqa: E402
from tests.models.test_models_decoder import RTOL, VOCAB, rel_err, tiny_pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    fams = ["gpt2", "llama", "mistral", "gemma2"]
    return {f: tiny_pair(f, tmp_path_factory.mktemp(f), seed=20 + i) for i, f in enumerate(fams)}


def model_kv(model, pages=40, P=4, **kw) -> PagedKV:
    c = model.config
    return PagedKV(c.n_layers, pages, P, c.n_kv_heads, c.head_dim, max_seqs=6,
                   max_pages_per_seq=10, **kw)  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "gemma2"])
def test_packed_steps_equal_each_sequence_alone(pairs, family):
    """Three sequences advance by different chunks each step (a long chunk of 20 that attends
    as one query block, short ones of 7, 5 and 3 whose tokens attend as rows, decode tokens; a
    window of 5 that drops keys; Gemma's soft-cap on the PyTorch path): the logits of every
    token equal a full forward of its sequence alone."""
    _, ours = pairs[family]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(2, VOCAB, (n,), generator=g) for n in (30, 9, 6)]
    kv = model_kv(ours)
    ids = kv.add_sequences(3)
    assert PACKED_ROWS_MAX < 20
    schedule = [(20, 5, 1), (7, 1, 1), (3, 3, 4)]  # tokens per sequence per step
    done = [0, 0, 0]
    got = [[] for _ in seqs]
    with torch.no_grad():
        for counts in schedule:
            run = [b for b in range(3) if counts[b]]
            tokens = torch.cat([seqs[b][done[b] : done[b] + counts[b]] for b in run])
            step = kv.plan_packed([ids[b] for b in run], [counts[b] for b in run])
            logits = ours(tokens[None], cache=step)[0]  # (T, vocab)
            for b in run:
                got[b].append(logits[: counts[b]])
                logits = logits[counts[b] :]
                done[b] += counts[b]
        for b, s in enumerate(seqs):
            full = ours(s[None])[0]
            ours_b = torch.cat(got[b])
            assert rel_err(ours_b, full, torch.ones_like(full, dtype=torch.bool)) <= RTOL
    kv.check()


def test_plan_packed_refuses_bad_counts_and_a_full_pool_changing_nothing(pairs):
    _, ours = pairs["llama"]
    kv = model_kv(ours, pages=3)
    a, b = kv.add_sequences(2)
    kv.plan_packed([a], [5])  # 2 pages
    with pytest.raises(ValueError, match="counts must hold one int >= 1 per sequence"):
        kv.plan_packed([a, b], [1])
    with pytest.raises(ValueError, match="counts must hold one int >= 1 per sequence"):
        kv.plan_packed([a, b], [1, 0])
    with pytest.raises(RuntimeError, match="needs 2 free page"):
        kv.plan_packed([a, b], [1, 5])
    assert (kv.length(a), kv.length(b), kv.pool.num_free) == (5, 0, 1)
    kv.check()


def test_packed_layer_refuses_weights_and_row_ordered_masks(pairs):
    _, ours = pairs["llama"]
    kv = model_kv(ours)
    a = kv.add_sequence()
    step = kv.plan_packed([a], [3])
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="masks of positions only"):
        step.layers[0].attend(q, k, v, mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert kv.length(a) == 0  # the failed step was undone
    step = kv.plan_packed([a], [3])
    with pytest.raises(ValueError, match=r"q must be \(1, H, T=3, ·\)"):
        step.layers[0].attend(q[:, :, :2], k, v)
    step = kv.plan_packed([a], [3])
    with pytest.raises(ValueError, match="does not return attention weights"):
        step.layers[0].attend(q, k, v, return_weights=True)
    kv.check()


# -- quantised pages -------------------------------------------------------------------------------


def _kv_rows(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g) * 3


def test_int8_pages_store_each_tokens_quantised_values_and_copy_scales_on_write(pairs):
    kv = PagedKV(1, 8, 4, 2, 8, max_seqs=3, max_pages_per_seq=4, dtype=torch.int8)
    a = kv.add_sequence()
    k, v = _kv_rows(6, seed=1)
    step = kv.plan_packed([a], [6])
    kv.write(
        0, step.layers[0].plan, k[0].transpose(0, 1)[:, :, None], v[0].transpose(0, 1)[:, :, None]
    )
    b = kv.fork(a)  # shares the partly filled second page
    k2, v2 = _kv_rows(1, seed=2)
    step = kv.plan_packed([b], [1])  # copy-on-write of the shared page, scales included
    kv.write(
        0, step.layers[0].plan, k2[0].transpose(0, 1)[:, :, None], v2[0].transpose(0, 1)[:, :, None]
    )
    for sid, keys, vals in ((a, k, v), (b, torch.cat([k, k2], 2), torch.cat([v, v2], 2))):
        gk, gv = kv.gather(sid)  # (Hkv, n, D) float32
        for got, x in ((gk, keys), (gv, vals)):
            rows = x[0].transpose(0, 1)  # (n, Hkv, D)
            assert torch.equal(got.transpose(0, 1), dequantize(*quantize_int8(rows)))
    assert kv.nbytes == 2 * 8 * 4 * 2 * (8 + 2)  # int8 values and bfloat16 scales, K and V
    kv.check()


def test_fp8_scales_are_fixed_by_the_first_write():
    kv = PagedKV(2, 4, 4, 2, 8, max_seqs=2, max_pages_per_seq=4, dtype=torch.float8_e4m3fn)
    a = kv.add_sequence()
    k, v = _kv_rows(3, seed=3)
    rows = (k[0].transpose(0, 1)[:, :, None], v[0].transpose(0, 1)[:, :, None])
    kv.write(1, kv.plan_packed([a], [3]).layers[1].plan, *rows)
    want = k.abs().amax(dim=(0, 2, 3)) * (FP8_HEADROOM / FP8_MAX)
    torch.testing.assert_close(kv.k_scales[1], want)
    assert torch.equal(kv.k_scales[0], torch.ones(2))  # layer 0 not written yet
    big = tuple(r * 100 for r in rows)
    kv.write(1, kv.plan_packed([a], [3]).layers[1].plan, *big)  # saturates, scales kept
    torch.testing.assert_close(kv.k_scales[1], want)
    gk, _ = kv.gather(a, layer=1)
    first = k[0].transpose(0, 1)  # (3, Hkv, D)
    assert torch.equal(gk.transpose(0, 1)[:3], dequantize(*quantize_fp8(first, want)))


# -- logits_to_keep --------------------------------------------------------------------------------


def test_logits_to_keep_takes_a_tensor_of_positions(pairs):
    _, ours = pairs["gpt2"]
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    keep = torch.tensor([0, 4, 8, 4])
    with torch.no_grad():
        full = ours(ids)
        some = ours(ids, logits_to_keep=keep)
    assert some.shape == (1, 4, VOCAB)
    torch.testing.assert_close(some, full[:, keep])
    with pytest.raises(ValueError, match=r"positions must lie in 0\.\.8"):
        ours(ids, logits_to_keep=torch.tensor([9]))
    with pytest.raises(ValueError, match="must be 1-D integer positions"):
        ours(ids, logits_to_keep=torch.tensor([[1]]))
