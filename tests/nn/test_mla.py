"""Multi-head latent attention (selfattn.nn.LatentAttention): the naive and absorbed orders
agree, the latent caches (static, paged) match a full forward, and the cache arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from selfattn import masks
from selfattn.cache import LatentCache, PagedLatentKV, kv_cache_bytes, latent_cache_bytes
from selfattn.cache.size import kv_shape_from_config
from selfattn.cli.main import main
from selfattn.nn import LatentAttention
from selfattn.positions import RoPE
from selfattn.testing import assert_close_to_reference

# d, H, kv_lora_rank, nope, rope, v, q_lora_rank: odd sizes, dv != dn + dr
SIZES = dict(d=22, H=3, r=11, dn=7, dr=6, dv=5)


def _layer(seed, *, q_lora_rank=None, dtype=torch.float64, interleaved=False):
    torch.manual_seed(seed)
    s = SIZES
    return LatentAttention(
        s["d"], s["H"], kv_lora_rank=s["r"], qk_nope_head_dim=s["dn"], qk_rope_head_dim=s["dr"],
        v_head_dim=s["dv"], q_lora_rank=q_lora_rank, rope=RoPE(s["dr"], interleaved=interleaved),
        dtype=dtype,
    )  # fmt: skip


def _run(m, x, order, **kw):
    m.order = order
    return m(x, **kw)


@pytest.mark.parametrize("q_lora_rank", [None, 5])
@pytest.mark.parametrize("Sq", [1, 9])
def test_naive_equals_absorbed_float64(q_lora_rank, Sq):
    m = _layer(0, q_lora_rank=q_lora_rank, interleaved=q_lora_rank is None)
    x = torch.randn(2, Sq, SIZES["d"], dtype=torch.float64)
    naive = _run(m, x, "naive", mask=masks.causal())
    absorbed = _run(m, x, "absorbed", mask=masks.causal())
    torch.testing.assert_close(absorbed, naive, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_low_precision_by_ratio_rule(dtype):
    m64 = _layer(1)
    x = torch.randn(3, 13, SIZES["d"], dtype=torch.float64)
    oracle = _run(m64, x, "naive", mask=masks.causal())
    m = _layer(1, dtype=dtype)
    m.load_state_dict(m64.state_dict())
    naive = _run(m, x.to(dtype), "naive", mask=masks.causal())
    absorbed = _run(m, x.to(dtype), "absorbed", mask=masks.causal())
    assert_close_to_reference(absorbed, oracle, naive, dtype=dtype)


def test_gradients_agree_and_gradcheck():
    m = _layer(2, q_lora_rank=4)
    x = torch.randn(2, 5, SIZES["d"], dtype=torch.float64, requires_grad=True)
    grads = {}
    for order in ("naive", "absorbed"):
        m.zero_grad()
        x.grad = None
        _run(m, x, order, mask=masks.causal()).square().sum().backward()
        grads[order] = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    for a, b in zip(grads["naive"], grads["absorbed"]):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    m.order = "absorbed"
    small = torch.randn(1, 3, SIZES["d"], dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: m(t, mask=masks.causal()), (small,), fast_mode=True)


def test_auto_order_absorbs_for_decode_only():
    m = _layer(3)
    assert m.absorbed_is_cheaper(1, 4096)
    assert not m.absorbed_is_cheaper(4096, 4096)  # prefill: dn + dv < 2 r


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_latent_cache_decode_equals_full_forward(kind):
    m = _layer(4, q_lora_rank=6)
    B, S, prefill = 2, 10, 6
    x = torch.randn(B, S, SIZES["d"], dtype=torch.float64)
    full = _run(m, x, "naive", mask=masks.causal())
    m.order = "auto"
    r, dr = SIZES["r"], SIZES["dr"]
    if kind == "static":
        cache = LatentCache(B, S, r, dr, dtype=torch.float64)
        assert cache.v.data_ptr() == cache.k.data_ptr() and cache.k.shape == (B, 1, S, r + dr)
        steps = [m(x[:, :prefill], mask=masks.causal(), cache=cache)]
        steps += [m(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(prefill, S)]
    else:
        kv = PagedLatentKV(1, 8, 3, r, dr, max_seqs=B, max_pages_per_seq=4, dtype=torch.float64)
        assert kv.v_store.data_ptr() == kv.k_store.data_ptr()
        view = kv.view(kv.add_sequences(B))
        steps = []
        for a, b in [(0, prefill), *((t, t + 1) for t in range(prefill, S))]:
            step = view.plan(b - a)
            layer = step.layers[0]
            steps.append(m(x[:, a:b], mask=masks.causal(), cache=layer, positions=step.positions))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_latent_cache_errors_name_the_value():
    with pytest.raises(ValueError, match="rope_dim"):
        LatentCache(1, 4, 8, 0)
    with pytest.raises(ValueError, match="order"):
        LatentAttention(8, 2, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                        v_head_dim=2, order="fast")  # fmt: skip


def test_latent_cache_bytes_formula_matches_storage():
    L, r, dr, T, B = 3, 11, 6, 17, 2
    caches = [LatentCache(B, T, r, dr, dtype=torch.bfloat16) for _ in range(L)]
    stored = sum(c.k.nbytes for c in caches)  # v is a view: no bytes of its own
    assert latent_cache_bytes(L, r, dr, T, "bf16", batch=B) == stored == L * (r + dr) * T * 2 * B
    # the same heads cached per head: K of dn + dr, V of dv
    assert kv_cache_bytes(L, 4, 13, T, "bf16", batch=B, value_dim=5) == L * 4 * 18 * T * 2 * B


DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "hidden_size": 7168,
    "torch_dtype": "bfloat16",
}


def test_kv_shape_from_mla_config():
    shape = kv_shape_from_config(DEEPSEEK_V3)
    assert shape.latent and shape.bytes(1, "bf16") == 61 * 576 * 2
    assert shape.mha_bytes(1, "bf16") == 61 * 128 * (192 + 128) * 2


def test_kv_size_cli_mla(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    assert main(["kv-size", "--config", str(path), "--tokens", "4096", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == 61 * 576 * 2 * 4096
    kinds = {a["kind"]: a for a in result["attention"]}
    assert kinds["MLA"]["bytes"] == result["bytes"]
    assert kinds["MHA"]["ratio"] == pytest.approx(128 * 320 / 576)
    assert main(["kv-size", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert "multi-head latent attention" in text and "71.1x" in text
    argv = ["kv-size", "--layers", "2", "--kv-lora-rank", "16", "--rope-dim", "8", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 2 * 24 * 2
    assert main(["kv-size", "--preset", "deepseek-v3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == result["bytes"]  # the same shape


def test_auto_avoids_sdpa_math_kernel_for_latent_values_on_cpu():
    """The absorbed call has Dv (r) != D (r + dr): SDPA's CPU flash kernel cannot run it and
    its math kernel is slower than chunked (benchmarks/mla.py), so auto takes a tile backend.
    (A call too small for the tile backends' per-call set-up, their ``Cost.fixed``, stays on
    sdpa: 128 heads over 4,096 latent rows, a DeepSeek-V3 decode step, is past that.)"""
    import selfattn as sa

    torch.manual_seed(5)
    q, rows = torch.randn(1, 128, 1, 24), torch.randn(1, 1, 4096, 24)
    ex = sa.backends.explain(q, rows, rows[..., :20], print_table=False)
    assert ex.chosen in ("chunked", "cpu_fused") and "Dv != D" in str(ex.costs["sdpa"])
    same = sa.backends.explain(q, rows, rows, print_table=False)
    assert same.chosen == "sdpa"


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_paged_attention_reads_latent_pages_in_place(backend):
    """Latent pages ``(N, P, 1, r + dr)`` with values the view ``[..., :r]``: every paged
    backend (Triton in its interpreter on CPU) equals the float64 oracle over the gathered rows."""
    import os

    import selfattn as sa

    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    torch.manual_seed(6)
    r, dr, P, N = SIZES["r"], SIZES["dr"], 4, 9
    kv = PagedLatentKV(1, N, P, r, dr, max_seqs=2, max_pages_per_seq=4)
    kv.k_store.normal_()
    pages, values = kv.k_layers[0], kv.v_layers[0]
    table = torch.tensor([[5, 0, 7, -1], [2, 8, 1, 3]], dtype=torch.int32)
    lens = torch.tensor([11, 14], dtype=torch.int32)
    q = torch.randn(2, SIZES["H"], 1, r + dr)
    out = sa.cache.paged_attention(q, pages, values, table, lens, scale=0.3, backend=backend)
    for b in range(2):
        rows = pages[table[b, table[b] >= 0].long()].flatten(0, 1)[: lens[b]]  # (n, 1, r + dr)
        k = rows.transpose(0, 1)[None].double()  # (1, 1, n, r + dr)
        want = sa.attention(q[b : b + 1].double(), k, k[..., :r], scale=0.3, backend="reference")
        naive = sa.attention(q[b : b + 1], k.float(), k.float()[..., :r], scale=0.3)
        assert_close_to_reference(out[b : b + 1], want, naive)


def test_paged_latent_fork_copies_on_write():
    """A forked sequence shares the latent pages; the next writes copy the shared last page and
    each sequence reads its own token, values still the view of its rows."""
    torch.manual_seed(7)
    kv = PagedLatentKV(2, 8, 4, 6, 2, max_seqs=3, max_pages_per_seq=4)
    a = kv.add_sequence()
    plan, rows = kv.plan([a], 6), torch.randn(1, 1, 6, 8)
    for layer in range(2):
        kv.write(layer, plan, rows, rows[..., :6])
    b = kv.fork(a)
    plan, new = kv.plan([a, b], 1), torch.randn(2, 1, 1, 8)
    for layer in range(2):
        kv.write(layer, plan, new, new[..., :6])
    for i, s in enumerate((a, b)):
        k, v = kv.gather(s, 1)
        assert torch.equal(k[0, :6], rows[0, 0]) and torch.equal(k[0, 6], new[i, 0, 0])
        assert torch.equal(v, k[..., :6])
    kv.check()
