"""selfattn.positions: RoPE (+ scalings, 2-D), sinusoidal/learned tables, ALiBi slopes.

Parity: inverse frequencies and attention factors against transformers' ROPE_INIT_FUNCTIONS, the
rotation against transformers' Llama rotary embedding and a float64 complex-number reference.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from selfattn import positions as P
from selfattn import scores

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_config(head_dim, base, params, max_position=4096):
    """A tiny LlamaConfig whose rope_parameters hold ``params`` (transformers 5 format)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaConfig(
            hidden_size=2 * head_dim,
            num_attention_heads=2,
            head_dim=head_dim,
            max_position_embeddings=max_position,
            rope_parameters={"rope_theta": base, **params},
        )


def _reference_rotation(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved):
    """Float64 RoPE via complex multiplication, written independently of the module."""
    x = x.double()
    r = 2 * inv_freq.numel()
    rot = x[..., :r]
    if not interleaved:  # half-split pair i is (i, i + r/2): bring it to (2i, 2i + 1)
        rot = torch.stack((rot[..., : r // 2], rot[..., r // 2 :]), -1).flatten(-2)
    z = torch.view_as_complex(rot.unflatten(-1, (r // 2, 2)).contiguous())
    angle = pos.double()[..., None] * inv_freq.double()
    if pos.dim() == 2:
        angle = angle[:, None]
    out = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    if not interleaved:
        out = torch.cat((out[..., 0::2], out[..., 1::2]), -1)
    return torch.cat((out, x[..., r:]), -1)


# -- parity with transformers: inverse frequencies and attention factors ----------------------

HEAD_DIMS = [(64, 1.0), (40, 1.0), (128, 0.5), (96, 0.25)]  # (head_dim, partial_rotary_factor)


def _assert_freq_parity(rope: P.RoPE, hf, seq_len=None):
    ours, attn = rope.frequencies(seq_len if seq_len is not None else 1)
    theirs, their_attn = hf
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=3e-6, atol=0)
    assert attn == pytest.approx(their_attn, rel=1e-12)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 1234.5])
@pytest.mark.parametrize("head_dim", [64, 40, 8, 128])
def test_default_inv_freq_matches_transformers(head_dim, base):
    cfg = _hf_config(head_dim, base, {"rope_type": "default"})
    rope = P.RoPE(head_dim, base)
    _assert_freq_parity(
        rope, modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    )
    torch.testing.assert_close(rope.inv_freq, modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq)
    assert rope.attention_factor == 1.0


@pytest.mark.parametrize("factor", [1.0, 2.0, 8.0, 3.7])
@pytest.mark.parametrize(("head_dim", "partial"), HEAD_DIMS)
def test_linear_matches_transformers(head_dim, partial, factor):
    cfg = _hf_config(head_dim, 10000.0, {"rope_type": "linear", "factor": factor})
    cfg.rope_parameters["partial_rotary_factor"] = partial
    rope = P.RoPE(head_dim, 10000.0, P.Linear(factor), rotary_dim=int(head_dim * partial))
    _assert_freq_parity(rope, ROPE_INIT_FUNCTIONS["linear"](cfg))


@pytest.mark.parametrize("seq_len", [1, 100, 2048, 2049, 5000, 131072])
@pytest.mark.parametrize("factor", [2.0, 4.0])
@pytest.mark.parametrize(("head_dim", "partial"), HEAD_DIMS[::2])
def test_dynamic_ntk_matches_transformers(head_dim, partial, factor, seq_len):
    cfg = _hf_config(head_dim, 10000.0, {"rope_type": "dynamic", "factor": factor}, 2048)
    cfg.rope_parameters["partial_rotary_factor"] = partial
    scaling = P.DynamicNTK(factor, original_max_position=2048)
    rope = P.RoPE(head_dim, 10000.0, scaling, rotary_dim=int(head_dim * partial))
    _assert_freq_parity(rope, ROPE_INIT_FUNCTIONS["dynamic"](cfg, seq_len=seq_len), seq_len)


YARN_CASES = [
    {"factor": 4.0},
    {"factor": 16.0, "beta_fast": 16.0, "beta_slow": 2.0},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek-V2 style
    {"factor": 8.0, "attention_factor": 1.3},
    {"factor": 1.0},
]


@pytest.mark.parametrize("base", [10000.0, 1000000.0])
@pytest.mark.parametrize(
    "case", YARN_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize(("head_dim", "partial"), HEAD_DIMS)
def test_yarn_matches_transformers(head_dim, partial, case, base):
    params = {"rope_type": "yarn", "original_max_position_embeddings": 4096, **case}
    cfg = _hf_config(head_dim, base, params, max_position=int(4096 * case["factor"]))
    cfg.rope_parameters["partial_rotary_factor"] = partial
    scaling = P.YaRN(original_max_position=4096, **case)
    rope = P.RoPE(head_dim, base, scaling, rotary_dim=int(head_dim * partial))
    _assert_freq_parity(rope, ROPE_INIT_FUNCTIONS["yarn"](cfg))


@pytest.mark.parametrize(
    ("factor", "low", "high", "original"),
    [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 2.0, 8.0, 1024), (2.0, 1.0, 3.0, 300)],
)
@pytest.mark.parametrize("base", [500000.0, 10000.0])
@pytest.mark.parametrize(("head_dim", "partial"), HEAD_DIMS)
def test_llama3_matches_transformers(head_dim, partial, base, factor, low, high, original):
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    cfg = _hf_config(head_dim, base, params)
    cfg.rope_parameters["partial_rotary_factor"] = partial
    scaling = P.Llama3(factor, original, low_freq_factor=low, high_freq_factor=high)
    rope = P.RoPE(head_dim, base, scaling, rotary_dim=int(head_dim * partial))
    _assert_freq_parity(rope, ROPE_INIT_FUNCTIONS["llama3"](cfg))


@pytest.mark.parametrize("seq_len", [None, 100, 4096, 4097, 20000])
@pytest.mark.parametrize(
    ("max_position", "attention_factor"),
    [(131072, None), (6000, None), (4096, None), (16384, 1.19)],
)
@pytest.mark.parametrize(("head_dim", "partial"), [(64, 1.0), (96, 0.5)])
def test_longrope_matches_transformers(head_dim, partial, max_position, attention_factor, seq_len):
    n = int(head_dim * partial) // 2
    g = _gen(n + max_position)
    short = (1.0 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64)).tolist()
    long = (1.0 + 30.0 * torch.rand(n, generator=g, dtype=torch.float64)).sort().values.tolist()
    params = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 4096,
    }
    if attention_factor is not None:
        params["attention_factor"] = attention_factor
    cfg = _hf_config(head_dim, 10000.0, params, max_position=max_position)
    cfg.rope_parameters["partial_rotary_factor"] = partial
    scaling = P.LongRoPE(short, long, 4096, attention_factor, max_position=max_position)
    rope = P.RoPE(head_dim, 10000.0, scaling, rotary_dim=2 * n)
    theirs = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=seq_len)
    _assert_freq_parity(rope, theirs, seq_len)


@pytest.mark.parametrize(
    "scaling",
    [None, P.YaRN(4.0, 256), P.Llama3(8.0, 128), P.Linear(2.0)],
    ids=["default", "yarn", "llama3", "linear"],
)
def test_rotation_matches_transformers_llama(scaling):
    """End to end: our rope(q) equals transformers' cos/sin + apply_rotary_pos_emb (float32)."""
    names = {P.YaRN: "yarn", P.Llama3: "llama3", P.Linear: "linear"}
    params = {"rope_type": names.get(type(scaling), "default")}
    if scaling is not None:
        params["factor"] = scaling.factor
    if isinstance(scaling, (P.YaRN, P.Llama3)):
        params["original_max_position_embeddings"] = scaling.original_max_position
    if isinstance(scaling, P.Llama3):
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    cfg = _hf_config(32, 10000.0, params, max_position=2048)
    hf = modeling_llama.LlamaRotaryEmbedding(cfg)
    g = _gen(7)
    q = torch.randn(2, 3, 37, 32, generator=g)
    pos = torch.randint(0, 700, (2, 37), generator=g)
    cos, sin = hf(q, pos)
    expected, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    rope = P.RoPE(32, 10000.0, scaling)
    assert rope.attention_factor == pytest.approx(hf.attention_scaling)
    # transformers forms angles in float32 (error ~ 700 * 2^-24 rad); ours are float64.
    torch.testing.assert_close(rope(q, pos), expected, rtol=0, atol=2e-4)


# -- precision ------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [2**17 - 1, 2**17], ids=["cached", "beyond-cache"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_bf16_at_large_positions_matches_float64(interleaved, top):
    g = _gen(11)
    x = torch.randn(1, 2, 33, 64, generator=g).bfloat16()
    pos = torch.cat((torch.randint(0, top, (31,), generator=g), torch.tensor([top, top - 1])))
    # model.to(bf16) casts float buffers; the angles must not follow it
    rope = P.RoPE(64, interleaved=interleaved).to(torch.bfloat16)
    ref = _reference_rotation(x, pos, P.RoPE(64).frequencies(1)[0], interleaved)
    out = rope(x, pos)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of the exact result: relative error <= 2^-9; allow 2^-8.
    bound = 2.0**-8 * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max():.3e}, mean {err.mean():.3e}"
    # The same check catches angles formed in bf16 (the bug this guards against).
    inv_bf16 = P.RoPE(64).inv_freq.bfloat16()
    angle = pos.bfloat16()[..., None] * inv_bf16
    bad = _reference_rotation(x, torch.zeros_like(pos), inv_bf16, interleaved)
    half = 32
    a, b = (bad[..., 0::2], bad[..., 1::2]) if interleaved else (bad[..., :half], bad[..., half:])
    c, s = angle.double().cos(), angle.double().sin()
    naive = torch.stack((a * c - b * s, b * c + a * s), -1)
    naive = naive.flatten(-2) if interleaved else torch.cat(naive.unbind(-1), -1)
    assert not ((naive.bfloat16().double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_dtype_preserved_and_accurate(dtype):
    g = _gen(3)
    x = torch.randn(2, 3, 9, 16, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (2, 9), generator=g)
    rope = P.RoPE(16, base=500.0)
    out = rope(x, pos)
    assert out.dtype == dtype
    ref = _reference_rotation(x, pos, rope.frequencies(1)[0], False)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


# -- invariants -------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, None), (59, 20), (8, 2)])
def test_rotation_preserves_norms(head_dim, rotary_dim, interleaved):
    g = _gen(head_dim)
    x = torch.randn(2, 3, 11, head_dim, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 10**6, (2, 11), generator=g)
    out = P.RoPE(head_dim, interleaved=interleaved, rotary_dim=rotary_dim)(x, pos)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    assert not torch.allclose(out, x)


@pytest.mark.parametrize(
    "scaling", [None, P.Linear(3.0), P.NTK(4.0), P.YaRN(8.0, 64), P.Llama3(8.0, 64)]
)
@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_relative_offset(scaling, interleaved):
    g = _gen(5)
    q = torch.randn(1, 2, 7, 24, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 13, 24, generator=g, dtype=torch.float64)
    rope = P.RoPE(24, scaling=scaling, interleaved=interleaved, rotary_dim=18)
    qp, kp = torch.arange(6, 13), torch.arange(13)
    scores_0 = rope(q, qp) @ rope(k, kp).transpose(-1, -2)
    for shift in (1, 977, 123456):
        shifted = rope(q, qp + shift) @ rope(k, kp + shift).transpose(-1, -2)
        torch.testing.assert_close(shifted, scores_0, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(scores_0, q @ k.transpose(-1, -2) * rope.attention_factor**2)


@pytest.mark.parametrize("rotary_dim", [None, 12])
def test_interleaved_is_a_permutation_of_half_split(rotary_dim):
    g = _gen(9)
    x = torch.randn(2, 2, 6, 20, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 300, (6,), generator=g)
    r = rotary_dim or 20
    # interleaved dim 2i <-> half-split dim i, 2i + 1 <-> i + r/2; the tail stays in place
    perm = torch.cat((torch.stack((torch.arange(r // 2), torch.arange(r // 2) + r // 2), -1)
                      .flatten(), torch.arange(r, 20)))  # fmt: skip
    half = P.RoPE(20, rotary_dim=rotary_dim)(x, pos)
    inter = P.RoPE(20, rotary_dim=rotary_dim, interleaved=True)(x[..., perm], pos)
    torch.testing.assert_close(inter, half[..., perm], rtol=0, atol=1e-14)


def test_partial_rotary_leaves_tail_untouched():
    g = _gen(13)
    x = torch.randn(2, 3, 7, 48, generator=g).bfloat16()
    pos = torch.randint(0, 1000, (7,), generator=g)
    out = P.RoPE(48, rotary_dim=16)(x, pos)
    assert torch.equal(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(out[..., :16], P.RoPE(16)(x[..., :16].contiguous(), pos))


def test_batched_positions_equal_per_sequence_calls():
    g = _gen(17)
    x = torch.randn(3, 2, 5, 16, generator=g)
    pos = torch.randint(0, 100, (3, 5), generator=g)
    rope = P.RoPE(16, interleaved=True)
    out = rope(x, pos)
    for b in range(3):
        torch.testing.assert_close(out[b : b + 1], rope(x[b : b + 1], pos[b]), rtol=0, atol=0)
    assert torch.equal(rope(x, pos.int()), out)


def test_cache_grows_on_demand_and_agrees_with_a_fresh_module():
    g = _gen(19)
    x = torch.randn(1, 2, 4, 16, generator=g, dtype=torch.float64)
    rope = P.RoPE(16)
    assert rope.cached_length == 0
    rope(x, torch.arange(4))
    small = rope.cached_length
    assert small >= 4
    far = torch.tensor([3, 700, 5000, 2])
    out = rope(x, far)
    assert rope.cached_length >= 5001 > small
    torch.testing.assert_close(out, P.RoPE(16)(x, far), rtol=0, atol=0)
    ref = _reference_rotation(x, far, rope.frequencies(1)[0], False)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_attention_factor_scales_cos_and_sin():
    scaling = P.YaRN(16.0, 128)
    rope = P.RoPE(32, scaling=scaling)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(16.0) + 1.0)
    x = torch.randn(1, 1, 5, 32, generator=_gen(1), dtype=torch.float64)
    out = rope(x, torch.arange(5))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1) * rope.attention_factor)


def test_ntk_divides_the_lowest_frequency_by_factor():
    for d, factor in ((64, 4.0), (10, 2.5)):
        plain, _ = P.RoPE(d).frequencies(1)
        ntk, _ = P.RoPE(d, scaling=P.NTK(factor)).frequencies(1)
        assert ntk[0] == plain[0] == 1.0
        assert ntk[-1].item() == pytest.approx(plain[-1].item() / factor, rel=1e-12)
        assert (ntk[1:-1] < plain[1:-1]).all() and (ntk[1:-1] > plain[1:-1] / factor).all()


def test_length_dependent_scalings_switch_past_the_original_length():
    g = _gen(23)
    x = torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64)
    plain = P.RoPE(16)
    dyn = P.RoPE(16, scaling=P.DynamicNTK(4.0, 100))
    near, far = torch.tensor([0, 50, 99]), torch.tensor([0, 50, 299])
    torch.testing.assert_close(dyn(x, near), plain(x, near), rtol=0, atol=0)
    inv, _ = dyn.frequencies(300)
    expected_base = 10000.0 * (4.0 * 300 / 100 - 3.0) ** (16 / 14)
    torch.testing.assert_close(inv, P.RoPE(16, base=expected_base).frequencies(1)[0])
    torch.testing.assert_close(dyn(x, far), _reference_rotation(x, far, inv, False))
    # LongRoPE: short factors up to the original length, long ones past it
    short, long = [1.0] * 8, [float(i + 2) for i in range(8)]
    lr = P.RoPE(16, scaling=P.LongRoPE(short, long, 100))
    torch.testing.assert_close(lr(x, near), plain(x, near))
    inv_long = plain.frequencies(1)[0] / torch.tensor(long, dtype=torch.float64)
    torch.testing.assert_close(lr(x, far), _reference_rotation(x, far, inv_long, False))


def test_rope_gradients():
    x = torch.randn(1, 2, 4, 8, generator=_gen(29), dtype=torch.float64, requires_grad=True)
    rope = P.RoPE(8, rotary_dim=6, interleaved=True)
    assert torch.autograd.gradcheck(lambda t: rope(t, torch.tensor([0, 5, 2, 90])), (x,))


# -- 2-D RoPE ---------------------------------------------------------------------------------


def test_rope2d_grid_and_halves():
    grid = P.RoPE2D.grid(3, 4)
    assert grid.shape == (12, 2)
    assert grid[5].tolist() == [1, 1] and grid[-1].tolist() == [2, 3]
    x = torch.randn(2, 2, 12, 16, generator=_gen(31), dtype=torch.float64)
    out = P.RoPE2D(16)(x, grid)
    torch.testing.assert_close(out[..., :8], P.RoPE(8)(x[..., :8], grid[:, 0]))
    torch.testing.assert_close(out[..., 8:], P.RoPE(8)(x[..., 8:], grid[:, 1]))
    batched = P.RoPE2D(16)(x, grid.expand(2, 12, 2))
    torch.testing.assert_close(batched, out, rtol=0, atol=0)


def test_rope2d_scores_depend_only_on_2d_offset():
    g = _gen(37)
    q = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    rope = P.RoPE2D(16)
    grid = P.RoPE2D.grid(3, 4)
    base = rope(q, grid) @ rope(k, grid).transpose(-1, -2)
    moved = grid + torch.tensor([40, 7])
    torch.testing.assert_close(rope(q, moved) @ rope(k, moved).transpose(-1, -2), base)
    # a pure row shift differs from a pure column shift by the same amount
    rows, cols = grid + torch.tensor([1, 0]), grid + torch.tensor([0, 1])
    assert not torch.allclose(rope(q, rows) @ rope(k, grid).transpose(-1, -2),
                              rope(q, cols) @ rope(k, grid).transpose(-1, -2))  # fmt: skip


# -- absolute encodings, ALiBi ----------------------------------------------------------------


def test_sinusoidal_values_and_shapes():
    pe = P.Sinusoidal(10)
    pos = torch.tensor([[0, 3, 70000], [1, 2, 5]])
    out = pe(pos)
    assert out.shape == (2, 3, 10) and out.dtype == torch.float32
    for p, row in ((70000, out[0, 2]), (5, out[1, 2])):
        for i in range(5):
            angle = p / 10000.0 ** (2 * i / 10)
            assert row[2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert row[2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    torch.testing.assert_close(pe(pos[1]), out[1], rtol=0, atol=0)
    assert pe(torch.arange(4), dtype=torch.float64).dtype == torch.float64


def test_learned_positions_lookup_and_length_error():
    table = P.LearnedPositions(10, 6)
    out = table(torch.tensor([[0, 9], [4, 4]]))
    assert out.shape == (2, 2, 6)
    torch.testing.assert_close(out[0, 1], table.weight[9], rtol=0, atol=0)
    out.sum().backward()
    assert table.weight.grad[4].eq(2).all() and table.weight.grad[1].eq(0).all()
    with pytest.raises(ValueError, match=r"position 12 .*length 10"):
        table(torch.tensor([3, 12]))


def test_alibi_slopes_is_shared_with_scores():
    assert P.alibi_slopes is scores.alibi_slopes
    torch.testing.assert_close(P.alibi_slopes(8), 2.0 ** (-torch.arange(1, 9.0)))


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 16, "rotary_dim": 7}, r"rotary_dim \(7\) must be even"),
        ({"head_dim": 16, "rotary_dim": 18}, r"rotary_dim \(18\).*head_dim \(16\)"),
        ({"head_dim": 15}, r"rotary_dim \(15\) must be even"),
        ({"head_dim": 16, "base": 1.0}, r"base must be > 1, got 1.0"),
    ],
)
def test_rope_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.RoPE(**kwargs)


@pytest.mark.parametrize(
    "build",
    [
        lambda: P.Linear(0.5),
        lambda: P.NTK(0.5),
        lambda: P.DynamicNTK(0.5, 2048),
        lambda: P.YaRN(0.5, 2048),
        lambda: P.Llama3(0.5, 8192),
    ],
    ids=["linear", "ntk", "dynamic", "yarn", "llama3"],
)
def test_scaling_factor_below_one_raises(build):
    with pytest.raises(ValueError, match=r"factor must be >= 1.0, got 0.5"):
        build()


def test_scaling_validation_messages():
    with pytest.raises(ValueError, match=r"beta_fast \(1.0\) must be > beta_slow \(2.0\)"):
        P.YaRN(4.0, 2048, beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ValueError, match=r"high_freq_factor \(1.0\) must be > low_freq_factor"):
        P.Llama3(8.0, 8192, low_freq_factor=2.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match=r"original_max_position must be a positive int, got 0"):
        P.DynamicNTK(2.0, 0)
    with pytest.raises(ValueError, match=r"short_factor \(2 entries\) and long_factor \(3\)"):
        P.LongRoPE([1.0, 1.0], [1.0, 2.0, 3.0], 4096)
    with pytest.raises(ValueError, match=r"has 2 factors but rotary_dim 16 needs 8"):
        P.RoPE(16, scaling=P.LongRoPE([1.0, 1.0], [1.0, 2.0], 4096))
    with pytest.raises(TypeError, match=r"scaling must be one of"):
        P.RoPE(16, scaling={"rope_type": "linear"})
    assert hash(P.LongRoPE([1.0], [2.0], 10)) == hash(P.LongRoPE((1.0,), (2.0,), 10))


def test_positions_errors():
    rope = P.RoPE(8)
    x = torch.randn(2, 1, 3, 8)
    with pytest.raises(TypeError, match=r"integer tensor, got torch.float32"):
        rope(x, torch.arange(3.0))
    with pytest.raises(ValueError, match=r"positions shape \(4,\) does not match x \(B=2, S=3\)"):
        rope(x, torch.arange(4))
    with pytest.raises(ValueError, match=r"must be >= 0, got min -1"):
        rope(x, torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match=r"RoPE expects x \(B, H, S, D=8\), got shape \(2, 3, 8\)"):
        rope(x[:, 0], torch.arange(3))
    with pytest.raises(ValueError, match=r"divisible by 4, got 6"):
        P.RoPE2D(6)
    with pytest.raises(ValueError, match=r"expected \(3, 2\) or \(2, 3, 2\)"):
        P.RoPE2D(8)(x, torch.arange(3))
    with pytest.raises(ValueError, match=r"even int >= 2, got 7"):
        P.Sinusoidal(7)


def test_rope_memo_sees_in_place_position_changes():
    """RoPE memoises cos/sin for the last positions tensor; an in-place edit must not be missed."""
    rope = P.RoPE(8)
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    pos = torch.arange(3)
    first = rope(x, pos)
    assert torch.equal(rope(x, pos), first)  # memo hit: same answer
    pos += 5  # in place: the version counter moves
    moved = rope(x, pos)
    torch.testing.assert_close(moved, rope(x, torch.arange(5, 8)))
    assert not torch.allclose(moved, first)


def test_rope_under_inference_mode():
    """Inference tensors have no version counter; RoPE must still work (and not memoise)."""
    rope = P.RoPE(8)
    x = torch.randn(1, 2, 3, 8)
    want = rope(x, torch.arange(3))
    with torch.inference_mode():
        pos = torch.arange(3)
        assert torch.equal(rope(x, pos), want)
        pos += 1
        torch.testing.assert_close(rope(x, pos), rope(x, torch.arange(1, 4)))
