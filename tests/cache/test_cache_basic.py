"""selfattn.cache basics: kv_cache_bytes, the kv-size command, StaticCache, SlidingWindowCache."""

from __future__ import annotations

import json

import pytest
import torch

from selfattn import masks
from selfattn.cache import SlidingWindowCache, StaticCache, format_bytes, kv_cache_bytes
from selfattn.cache.base import KVCache
from selfattn.cli import main
from selfattn.nn import ContiguousCache, MultiHeadAttention

GiB, KiB = 2**30, 2**10


# -- kv_cache_bytes ------------------------------------------------------------------------------
def test_seed_example_llama2_7b():
    # The seed: 32 layers, 32 KV heads of dimension 128, 16-bit -> 512 KiB/token, 2 GiB/4096.
    assert kv_cache_bytes(32, 32, 128, 1, "fp16") == 524288 == 512 * KiB
    assert kv_cache_bytes(32, 32, 128, 4096, torch.bfloat16) == 2 * GiB
    assert kv_cache_bytes(32, 32, 128, 4096, "bf16", batch=3) == 6 * GiB
    assert format_bytes(524288) == "512 KiB" and format_bytes(2 * GiB) == "2 GiB"


def test_formula_and_dtypes():
    L, H, D, T, B = 3, 5, 7, 11, 2
    base = 2 * L * H * D * T * B
    for dt, nbytes in [("fp32", 4), (torch.float32, 4), ("fp16", 2), (torch.float64, 8)]:
        assert kv_cache_bytes(L, H, D, T, dt, batch=B) == base * nbytes
    assert kv_cache_bytes(L, H, D, T, "int8", batch=B) == base + 2 * L * H * T * 2 * B
    assert kv_cache_bytes(L, H, D, T, torch.int8, batch=B) == base + 2 * L * H * T * 2 * B
    assert kv_cache_bytes(L, H, D, T, "fp8", batch=B) == base + 2 * L * H * 4
    assert kv_cache_bytes(L, H, D, T, torch.float8_e4m3fn, batch=B) == base + 2 * L * H * 4


def test_mha_gqa_mqa_ratio_and_int8_savings():
    mha, gqa, mqa = (kv_cache_bytes(32, h, 128, 4096, "bf16") for h in (8, 2, 1))
    assert mha == 4 * gqa == 8 * mqa
    bf16 = kv_cache_bytes(32, 32, 128, 4096, "bf16")
    int8 = kv_cache_bytes(32, 32, 128, 4096, "int8")
    scales = 2 * 32 * 32 * 4096 * 2  # a bfloat16 scale per token and head, K and V
    assert int8 == bf16 // 2 + scales and int8 / bf16 == (128 + 2) / 256


@pytest.mark.parametrize(
    "args, needle",
    [
        ((0, 1, 1, 1, "fp16"), "layers must be a positive int, got 0"),
        ((1, -3, 1, 1, "fp16"), "kv_heads must be a positive int, got -3"),
        ((1, 1, 1, 0, "fp16"), "tokens must be a positive int, got 0"),
        ((1, 1, 2.5, 1, "fp16"), "head_dim must be a positive int, got 2.5"),
        ((1, 1, 1, 1, "fp4"), "unknown KV cache dtype 'fp4'"),
        ((1, 1, 1, 1, torch.int32), "unknown KV cache dtype torch.int32"),
    ],
)
def test_kv_cache_bytes_errors(args, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        kv_cache_bytes(*args)
    with pytest.raises(ValueError, match="batch must be a positive int, got 0"):
        kv_cache_bytes(1, 1, 1, 1, "fp16", batch=0)


# -- selfattn kv-size ----------------------------------------------------------------------------
def test_cli_default_is_the_seed_example(capsys):
    assert main(["kv-size"]) == 0
    out = capsys.readouterr().out
    assert "512 KiB per token" in out and "2 GiB" in out and "2,147,483,648" in out


def test_cli_json_ratios_and_storage(capsys):
    argv = ["kv-size", "--preset", "llama-2-7b", "--heads", "8", "--kv-heads", "8", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert [a["ratio"] for a in r["attention"]] == [8, 2, 1]
    sizes = [a["bytes"] for a in r["attention"]]
    assert sizes[0] == 4 * sizes[1] == 8 * sizes[2] == kv_cache_bytes(32, 8, 128, 4096, "bf16")
    storage = {s["dtype"]: s["bytes"] for s in r["storage"]}
    assert storage["int8"] == storage["bf16"] // 2 + 2 * 32 * 8 * 4096 * 2  # bfloat16 scales
    assert storage["fp8"] == storage["bf16"] // 2 + 2 * 32 * 8 * 4


@pytest.mark.parametrize(
    "preset, shape",
    [("llama-3-8b", (32, 8, 128)), ("gpt2", (12, 12, 64)), ("qwen2-7b", (28, 4, 128))],
)
def test_cli_presets_and_overrides(capsys, preset, shape):
    argv = ["kv-size", "--preset", preset, "--tokens", "37", "--batch", "3", "--dtype", "int8"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes"] == kv_cache_bytes(*shape, 37, "int8", batch=3)
    assert main([*argv, "--layers", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == kv_cache_bytes(
        5, *shape[1:], 37, "int8", batch=3
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
        (["--layers", "0"], "must be >= 1, got 0"),
        (["--tokens", "-4"], "must be >= 1, got -4"),
        (["--dtype", "fp4"], "unknown KV cache dtype 'fp4'"),
        (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be divisible by --kv-heads (4)"),
    ],
)
def test_cli_bad_values(capsys, argv, needle):
    assert main(["kv-size", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err


# -- StaticCache ---------------------------------------------------------------------------------
def _randomise(m, gen):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _rope_like(x, positions):
    """A tiny rotary map, so the tests see whether ``cache.length`` is the absolute position."""
    D = x.shape[-1]
    freq = 1.0 / (100.0 ** (torch.arange(D // 2, dtype=torch.float64) / (D // 2)))
    ang = positions.to(torch.float64)[..., None] * freq  # (S, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _model(seed, alibi=False):
    gen = torch.Generator().manual_seed(seed)
    m = MultiHeadAttention(12, 6, 2, rope=_rope_like, alibi=alibi, dtype=torch.float64).eval()
    _randomise(m, gen)
    return m, gen


def _assert_close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= 1e-11, f"{what}: max err {err:.3g}"


def test_static_cache_is_the_layer_cache_and_decodes_exactly():
    assert issubclass(StaticCache, ContiguousCache)
    m, gen = _model(3)
    B, S = 2, 13
    x = torch.randn(B, S, 12, generator=gen, dtype=torch.float64)
    full = m(x, mask=masks.causal())
    cache = StaticCache(B, S, 2, 2, dtype=torch.float64)  # exactly at capacity
    steps = [m(x[:, i : i + 5], mask=masks.causal(), cache=cache) for i in range(0, S, 5)]
    assert cache.length == S == cache.max_len
    _assert_close(torch.cat(steps, 1), full, "static cache")
    with pytest.raises(ValueError, match=r"13\.\.13 fall outside the cache's max_len \(13\)"):
        cache.update(torch.zeros(B, 2, 1, 2), torch.zeros(B, 2, 1, 2))
    k_all, _ = cache.update(torch.zeros(B, 2, 0, 2), torch.zeros(B, 2, 0, 2))
    assert k_all.data_ptr() == cache.k.data_ptr()  # a view of the preallocated storage
    cache.reset()
    assert len(cache) == 0


# -- SlidingWindowCache --------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("window, alibi", [(5, False), (3, True), (1, False)])
def test_window_cache_decode_equals_full_sliding_window(chunk, window, alibi):
    m, gen = _model(10 * window + chunk, alibi)
    B, S = 2, 23  # wraps the ring several times
    x = torch.randn(B, S, 12, generator=gen, dtype=torch.float64)
    mask = masks.sliding_window(window)
    full = m(x, mask=mask)
    cache = SlidingWindowCache(B, window, 2, 2, dtype=torch.float64)
    steps = []
    for i in range(0, S, chunk):
        before = cache.length
        steps.append(m(x[:, i : i + chunk], mask=mask, cache=cache))
        assert cache.key_start == max(0, before - (window - 1))
    assert cache.length == S and cache.k.shape[2] == window
    _assert_close(torch.cat(steps, 1), full, f"window {window}, chunks of {chunk}")


def test_window_cache_returns_position_order_and_checks_inputs():
    W, gen = 4, torch.Generator().manual_seed(5)
    cache = SlidingWindowCache(1, W, 1, 3, value_dim=2, dtype=torch.float64)
    ks = torch.randn(1, 1, 10, 3, generator=gen, dtype=torch.float64)
    vs = torch.randn(1, 1, 10, 2, generator=gen, dtype=torch.float64)
    cache.update(ks[:, :, :6], vs[:, :, :6])
    k_all, v_all = cache.update(ks[:, :, 6:8], vs[:, :, 6:8], torch.tensor([6, 7]))
    assert torch.equal(k_all, ks[:, :, 3:8]) and torch.equal(v_all, vs[:, :, 3:8])
    assert cache.key_start == 3 and len(cache) == 8
    with pytest.raises(ValueError, match=r"positions must be 8\.\.8 \(length=8, S=1\), got \[3\]"):
        cache.update(ks[:, :, :1], vs[:, :, :1], torch.tensor([3]))
    with pytest.raises(ValueError, match=r"k of shape \(B=1, Hkv=1, S, D=3\)"):
        cache.update(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 2))
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        SlidingWindowCache(1, 0, 1, 3)
    cache.reset()
    k_all, _ = cache.update(ks[:, :, 8:], vs[:, :, 8:])
    assert torch.equal(k_all, ks[:, :, 8:]) and cache.key_start == 0


# -- the contract: update returns keys with their positions ---------------------------------------
def test_update_returns_keys_with_their_absolute_positions():
    """StaticCache keys start at 0; a ring buffer says where its returned window starts."""
    gen = torch.Generator().manual_seed(21)
    ks = torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64)
    static = StaticCache(1, 9, 2, 3, dtype=torch.float64)
    kv = static.update(ks[:, :, :7], ks[:, :, :7])
    assert kv.start == 0 and torch.equal(kv.positions, torch.arange(7))
    ring = SlidingWindowCache(1, 4, 2, 3, dtype=torch.float64)
    ring.update(ks[:, :, :5], ks[:, :, :5])
    kv = ring.update(ks[:, :, 5:7], ks[:, :, 5:7])
    k_all, _ = kv  # still a (k, v) pair
    assert torch.equal(kv.positions, torch.arange(2, 7)) and kv.start == ring.key_start == 2
    assert torch.equal(k_all, ks[:, :, 2:7])
    assert isinstance(static, KVCache) and isinstance(ring, KVCache)


@pytest.mark.parametrize("chunk", [1, 3])
def test_window_cache_layer_sees_absolute_key_padding(chunk):
    """Left padding is an absolute mask (``~padding(starts)``): through a ring buffer that has
    wrapped, the layer must evaluate it at the keys' true positions to match the full pass."""
    m, gen = _model(31)
    B, S, W = 2, 17, 4
    x = torch.randn(B, S, 12, generator=gen, dtype=torch.float64)
    starts = torch.tensor([6, 0])  # row 0: keys 0..5 are padding
    mask = masks.sliding_window(W) & ~masks.padding(starts)
    full = m(x, mask=mask)
    cache = SlidingWindowCache(B, W, 2, 2, dtype=torch.float64)
    steps = [m(x[:, :7], mask=mask, cache=cache)]  # the prompt covers the padding
    steps += [m(x[:, i : i + chunk], mask=mask, cache=cache) for i in range(7, S, chunk)]
    got = torch.cat(steps, 1)
    _assert_close(got[0, 6:], full[0, 6:], "padded row")  # padded query rows attend nothing
    _assert_close(got[1], full[1], "unpadded row")


def test_cache_package_imports_nothing_above_it():
    """docs/design.md's layers: selfattn.cache sits below nn and models."""
    import ast
    import pathlib

    import selfattn.cache as pkg

    above = ("selfattn.nn", "selfattn.models", "selfattn.serving", "selfattn.inspect")
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad = [n for n in names if n.startswith(above)]
            assert not bad, f"{path.name} imports {bad}"
    assert ContiguousCache is StaticCache


def test_static_cache_appends_without_a_device_sync():
    """The default update (the next S slots) knows its slots on the host: no ``.item()``, so a
    compiled decode step does not break its graph here."""
    torch._dynamo.reset()
    cache = StaticCache(1, 8, 2, 4, dtype=torch.float64)
    cache.update(torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 2, 3, 4))

    def step(k, v):
        k_all, v_all = cache.update(k, v)
        return k_all.sum() + v_all.sum()

    k, v = (torch.randn(1, 2, 1, 4, dtype=torch.float64) for _ in range(2))
    explained = torch._dynamo.explain(step)(k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert cache.length == 4 and torch.equal(cache.k[:, :, 3:4], k)
