"""ViT against transformers' ViTModel; Swin-style windows against a per-window reference."""

from __future__ import annotations

import json

import pytest
import torch

from selfattn import masks
from selfattn.models import hub
from selfattn.models.vision import SwinBlock, ViT, ViTConfig, window_layout

transformers = pytest.importorskip("transformers")

TINY = dict(
    image_size=32,
    patch_size=8,
    hidden_size=48,
    num_attention_heads=3,
    num_hidden_layers=2,
    intermediate_size=37,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def save_vit(path, seed: int, **overrides):
    torch.manual_seed(seed)
    theirs = transformers.ViTModel(transformers.ViTConfig(**{**TINY, **overrides})).eval()
    theirs.save_pretrained(path)
    return theirs


@pytest.fixture(scope="module")
def vit_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit")
    theirs = save_vit(path, 0)
    return theirs, hub.from_pretrained(path), path


def test_vit_matches_transformers(vit_pair):
    theirs, ours, _ = vit_pair
    assert isinstance(ours, ViT) and not ours.training
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(pixel_values=x), ours(x)
    assert got.last_hidden_state.shape == (3, 17, 48)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-4
    assert rel_err(got.pooler_output, want.pooler_output) <= 1e-4


@pytest.mark.parametrize(
    "overrides",
    [
        dict(qkv_bias=False, hidden_act="gelu_new"),
        dict(image_size=(24, 40), patch_size=(8, 4), num_channels=1, pooler_output_size=7),
    ],
    ids=["no-qkv-bias-gelu-tanh", "rectangular-1-channel-pooler-7"],
)
def test_vit_config_variants(tmp_path, overrides):
    theirs = save_vit(tmp_path, 2, **overrides)
    ours = hub.from_pretrained(tmp_path)
    c = theirs.config
    size = _size(c.image_size)
    x = torch.randn(2, c.num_channels, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = theirs(pixel_values=x), ours(x)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-4
    assert rel_err(got.pooler_output, want.pooler_output) <= 1e-4


def _size(s):
    return (s, s) if isinstance(s, int) else tuple(s)


@pytest.mark.parametrize("size", [(48, 48), (24, 40)])
def test_vit_interpolated_positions(vit_pair, size):
    theirs, ours, _ = vit_pair
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs(pixel_values=x, interpolate_pos_encoding=True)
        got = ours(x, interpolate_pos_encoding=True)
    assert got.last_hidden_state.shape[1] == 1 + size[0] // 8 * (size[1] // 8)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-4


def test_vit_gradients_match(vit_pair):
    theirs, ours, _ = vit_pair
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    w = torch.randn(2, 48, generator=torch.Generator().manual_seed(6))
    (theirs(pixel_values=x).pooler_output * w).sum().backward()
    (ours(x).pooler_output * w).sum().backward()
    pairs = {
        "patch": (ours.patch_embed.weight, theirs.embeddings.patch_embeddings.projection.weight),
        "pos": (ours.pos_embed, theirs.embeddings.position_embeddings),
        "cls": (ours.cls_token, theirs.embeddings.cls_token),
        "fc1": (ours.blocks[0].mlp.fc1.weight, theirs.layers[0].mlp.fc1.weight),
        "q": (ours.blocks[1].attention.q_proj.weight, theirs.layers[1].attention.q_proj.weight),
    }
    for name, (a, b) in pairs.items():
        assert rel_err(a.grad, b.grad) <= 1e-4, name
    ours.zero_grad(), theirs.zero_grad()


def test_vit_loads_v5_module_names(vit_pair):
    """A state dict named like transformers v5's modules (``layers.i.attention.q_proj``) loads."""
    theirs, ours, _ = vit_pair
    fresh = ViT(ours.config)
    hub.load_state(fresh, ViT.convert_hf_state_dict(theirs.state_dict()))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).pooler_output, ours(x).pooler_output)


def test_vit_bad_images(vit_pair):
    _, ours, _ = vit_pair
    with pytest.raises(ValueError, match=r"C=3.*\(2, 1, 32, 32\)"):
        ours(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"\(32, 40\).*\(32, 32\).*interpolate_pos_encoding"):
        ours(torch.randn(2, 3, 32, 40))
    with pytest.raises(ValueError, match=r"\(32, 36\) must be a multiple of the patch \(8, 8\)"):
        ours(torch.randn(2, 3, 32, 36), interpolate_pos_encoding=True)
    with pytest.raises(ValueError, match=r"C=3.*\(3, 32, 32\)"):
        ours(torch.randn(3, 32, 32))


def test_vit_unsupported_configs(vit_pair, tmp_path):
    _, _, path = vit_pair
    config = json.loads((path / "config.json").read_text())
    for key, value, match in [
        ("architectures", ["ViTForImageClassification"], "architectures=.*ViTForImageClassif"),
        ("hidden_act", "quick_gelu", "hidden_act='quick_gelu'"),
        ("pooler_act", "mish", "pooler_act='mish'"),
    ]:
        with pytest.raises(hub.UnsupportedConfigError, match=match):
            ViT.from_config({**config, key: value})


def test_vit_config_validation():
    with pytest.raises(ValueError, match=r"d_model \(50\) must be divisible by n_heads \(3\)"):
        ViTConfig(d_model=50, n_heads=3)
    with pytest.raises(ValueError, match=r"image width \(30\) must be a multiple.*\(8\)"):
        ViTConfig(image_size=(32, 30), patch_size=(8, 8))


# ---------------------------------------------------------------------------------------------
# Swin-style shifted windows
# ---------------------------------------------------------------------------------------------


def swin_reference(block: SwinBlock, x: torch.Tensor) -> torch.Tensor:
    """Swin's own recipe with the block's weights: roll by -shift, partition into windows, softmax
    per window with the relative bias and the img_mask region mask, merge, roll back."""
    B, H, W, C = x.shape
    w, s = block.window, block.shift
    mha, table = block.block.attention, block.relative_position_bias_table
    nH, D = mha.n_heads, C // mha.n_heads
    h = block.block.attn_res.norm(x)
    h = torch.roll(h, (-s, -s), (1, 2))
    win = h.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
    q, k, v = mha.qkv_proj(win).view(-1, w * w, 3, nH, D).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-2, -1) * D**-0.5  # (B·nW, nH, w², w²)
    coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij"))
    coords = coords.flatten(1)
    rel = coords[:, :, None] - coords[:, None, :] + w - 1  # (2, w², w²)
    scores = scores + table[rel[0] * (2 * w - 1) + rel[1]].permute(2, 0, 1)
    if s:
        img = torch.zeros(H, W, dtype=torch.long)
        cut = (slice(0, -w), slice(-w, -s), slice(-s, None))
        for n, (hs, ws) in enumerate((hs, ws) for hs in cut for ws in cut):
            img[hs, ws] = n
        labels = img.view(H // w, w, W // w, w).permute(0, 2, 1, 3).reshape(-1, w * w)
        blocked = labels[:, :, None] != labels[:, None, :]  # (nW, w², w²)
        nW = labels.shape[0]
        scores = scores.view(B, nW, nH, w * w, w * w).masked_fill(
            blocked[None, :, None], -torch.inf
        )
        scores = scores.view(-1, nH, w * w, w * w)
    out = scores.softmax(-1) @ v  # (B·nW, nH, w², D)
    out = mha.out_proj(out.transpose(1, 2).reshape(-1, w * w, C))
    out = out.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
    x = x + torch.roll(out, (s, s), (1, 2))
    return x + block.block.mlp(block.block.mlp_res.norm(x))


def make_swin(C, nH, w, s, seed, dtype=torch.float64, backend="auto"):
    torch.manual_seed(seed)
    block = SwinBlock(C, nH, w, s, mlp_ratio=1.5, backend=backend).to(dtype)
    with torch.no_grad():
        block.relative_position_bias_table.normal_()  # Swin's 0.02 init would hide index errors
        for p in block.block.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return block


SWIN_CASES = [(8, 12, 4, 0), (8, 12, 4, 2), (6, 9, 3, 1), (12, 8, 4, 3)]


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize(
    "H, W, w, s", SWIN_CASES, ids=[f"{a}x{b}-w{c}-s{d}" for a, b, c, d in SWIN_CASES]
)
def test_swin_block_matches_per_window_reference(H, W, w, s, backend):
    seed = H * 100 + W + s
    block = make_swin(12, 3, w, s, seed, backend=backend)
    x = torch.randn(2, H, W, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = block(xa), swin_reference(block, xb)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    params = [block.relative_position_bias_table, block.block.attention.qkv_proj.weight]
    ga = torch.autograd.grad(got, [xa, *params], g)
    gb = torch.autograd.grad(want, [xb, *params], g)
    for name, a, b in zip(("x", "bias table", "qkv"), ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("shift", [0, 2])
def test_swin_block_matches_transformers_swin_layer(shift):
    """External parity: transformers' SwinLayer with the same weights (fp64)."""
    from transformers.models.swin import modeling_swin

    H, W, C, w = 8, 12, 12, 4
    torch.manual_seed(shift)
    config = transformers.SwinConfig(embed_dim=C, window_size=w, num_heads=[3], mlp_ratio=1.5)
    config._attn_implementation = "sdpa"  # eager takes its softmax in fp32 even for fp64 inputs
    theirs = (
        modeling_swin.SwinLayer(
            config, dim=C, input_resolution=(H, W), num_heads=3, shift_size=shift
        )
        .double()
        .eval()
    )
    ours = make_swin(C, 3, w, shift, 20 + shift)
    a, b = theirs.attention, ours.block
    with torch.no_grad():
        a.relative_position_bias.relative_position_bias_table.copy_(
            ours.relative_position_bias_table
        )
        a.q_proj.weight.copy_(b.attention.qkv_proj.weight[:C])
        a.k_proj.weight.copy_(b.attention.qkv_proj.weight[C : 2 * C])
        a.v_proj.weight.copy_(b.attention.qkv_proj.weight[2 * C :])
        bias = b.attention.qkv_proj.bias
        a.q_proj.bias.copy_(bias[:C]), a.k_proj.bias.copy_(bias[C : 2 * C])
        a.v_proj.bias.copy_(bias[2 * C :])
        a.o_proj.load_state_dict(b.attention.out_proj.state_dict())
        theirs.layernorm_before.load_state_dict(b.attn_res.norm.state_dict())
        theirs.layernorm_after.load_state_dict(b.mlp_res.norm.state_dict())
        theirs.mlp.fc1.load_state_dict(b.mlp.fc1.state_dict())
        theirs.mlp.fc2.load_state_dict(b.mlp.fc2.state_dict())
    x = torch.randn(2, H, W, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(x.view(2, H * W, C), (H, W))
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    torch.testing.assert_close(got.view(2, H * W, C), want, rtol=1e-10, atol=1e-10)


def test_swin_block_fp32_error_within_ratio_rule():
    block = make_swin(16, 4, 4, 2, 9, dtype=torch.float32, backend="chunked")
    x = torch.randn(2, 8, 8, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        exact = swin_reference(block.double(), x.double())
        ref32 = swin_reference(block.float(), x)
        ours = block(x)
    err_ref = (ref32.double() - exact).abs().max()
    err_ours = (ours.double() - exact).abs().max()
    assert err_ours <= 2 * err_ref + 8 * torch.finfo(torch.float32).eps * exact.abs().max()


@pytest.mark.parametrize("shift", [0, 4])
def test_swin_mask_tiles_grow_linearly(shift):
    """Window-major order makes the mask block diagonal: non-empty (64 × 64) tiles ~ patches."""
    block = SwinBlock(8, 2, 8, shift)
    counts = {}
    for side in (16, 32, 64):
        S = side * side
        _, mask, _ = block.mask_and_bias(side, side)
        kinds = mask.tile_kinds(masks.TileGrid(S, S, 64, 64))
        counts[S] = int((kinds != masks.EMPTY).sum())
        assert counts[S] <= 3 * (S // 64), (S, counts[S])  # ~1-2 tiles per query tile, not S/64
    # 16x the patches -> at most ~16x the tiles (a dense mask would give 256x)
    assert counts[4096] <= 20 * counts[256]
    # raster order would not be sparse: the same groups in raster order touch far more tiles
    lay = window_layout(64, 64, 8, shift)
    raster_ids = torch.empty_like(lay.ids)
    raster_ids[lay.order] = lay.ids
    raster = masks.documents(raster_ids).tile_kinds(masks.TileGrid(4096, 4096, 64, 64))
    assert int((raster != masks.EMPTY).sum()) > 2 * counts[4096]


def test_window_layout_is_a_permutation_with_sorted_groups():
    lay = window_layout(12, 8, 4, 3)
    assert torch.equal(lay.order.sort().values, torch.arange(96))
    assert bool((lay.ids.diff() >= 0).all())
    # 6 windows, the last row/column of windows split by the wrapped strips: 6 + 1 + 2 + 3 groups
    assert lay.ids.unique().numel() == 12


def test_swin_errors():
    with pytest.raises(ValueError, match=r"shift must be in \[0, window=4\), got 4"):
        SwinBlock(8, 2, 4, 4)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        SwinBlock(8, 2, 0)
    block = SwinBlock(8, 2, 4, 2)
    with pytest.raises(ValueError, match=r"grid \(8, 10\) must be a multiple of window=4"):
        block(torch.randn(1, 8, 10, 8))
    with pytest.raises(ValueError, match=r"\(B, H, W, C\), got shape \(64, 8\)"):
        block(torch.randn(64, 8))
    _, _, bias = block.mask_and_bias(8, 8)
    with pytest.raises(ValueError, match=r"window bias is for 64 tokens and 2 heads.*Sk=60"):
        bias.validate(1, 2, 60, 60, 0)
