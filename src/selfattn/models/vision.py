"""Vision transformers: ViT (Dosovitskiy et al., 2021) and Swin-style shifted-window attention.

ViT cuts an image into patches, embeds each with one strided convolution, prepends a learned class
token, adds learned positions and runs bidirectional pre-norm encoder blocks; the class token's
final state (after a Linear + tanh "pooler") summarises the image. It loads transformers'
``ViTModel`` folders through :func:`selfattn.models.from_pretrained`.

Swin (Liu et al., 2021) attends within ``w × w`` windows of the patch grid, alternating plain and
shifted windows; :class:`SwinBlock` expresses the windows as a ``selfattn.masks`` mask so that the
cost is linear in the number of patches (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from selfattn import masks
from selfattn._validate import one_of, positive_int
from selfattn.models.hub import register, unsupported
from selfattn.nn import MLP, EncoderBlock, LayerNorm, MultiHeadAttention
from selfattn.nn.mlp import ACTIVATIONS
from selfattn.scores import ScoreMod

__all__ = [
    "SwinBlock",
    "ViT",
    "ViTConfig",
    "ViTOutput",
    "WindowBias",
    "WindowLayout",
    "window_layout",
]


def _pair(x) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else tuple(x)


# ---------------------------------------------------------------------------------------------
# ViT
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViTConfig:
    image_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (16, 16)
    num_channels: int = 3
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_hidden: int = 3072
    activation: str = "gelu"
    eps: float = 1e-12
    qkv_bias: bool = True
    pooler_dim: int | None = 768  # None: no pooler
    pooler_activation: str = "tanh"
    dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        for side, (i, p) in zip(("height", "width"), zip(self.image_size, self.patch_size)):
            if i % p:
                raise ValueError(
                    f"image {side} ({i}) must be a multiple of the patch {side} ({p}); "
                    "crop or pad the images"
                )
        for name in ("activation", "pooler_activation"):
            one_of(getattr(self, name), name, ACTIVATIONS)

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return tuple(i // p for i, p in zip(self.image_size, self.patch_size))


class ViTOutput(NamedTuple):
    last_hidden_state: torch.Tensor  # (B, 1 + patches, d_model), class token first
    pooler_output: torch.Tensor | None  # (B, pooler_dim)


# transformers' tensor names -> ours, per encoder layer (both the saved legacy names and v5's).
_LAYER_NAMES = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.out_proj",
    "attention.q_proj": "attention.q_proj",
    "attention.k_proj": "attention.k_proj",
    "attention.v_proj": "attention.v_proj",
    "attention.o_proj": "attention.out_proj",
    "layernorm_before": "attn_res.norm",
    "layernorm_after": "mlp_res.norm",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_TOP_NAMES = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection": "patch_embed",
    "layernorm": "norm",
    "pooler.dense": "pooler",
}


def _vit_block(c: ViTConfig) -> EncoderBlock:
    """transformers' ViTLayer: pre-norm, separate q/k/v projections, GELU MLP."""
    d = c.d_model
    attention = MultiHeadAttention(
        d, c.n_heads, fused=False, bias=c.qkv_bias, out_bias=True, dropout=c.attention_dropout
    )
    mlp = MLP(d, c.d_hidden, activation=ACTIVATIONS[c.activation])
    norms = LayerNorm(d, eps=c.eps), LayerNorm(d, eps=c.eps)
    return EncoderBlock(attention, mlp, *norms, norm_first=True, dropout=c.dropout)


@register("vit")
class ViT(nn.Module):
    """``pixel_values (B, C, H, W)`` -> :class:`ViTOutput` (transformers' ``ViTModel``)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        c, d = config, config.d_model
        self.config = c
        self.patch_embed = nn.Conv2d(c.num_channels, d, c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        n_patches = c.grid[0] * c.grid[1]
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + n_patches, d) * 0.02)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(_vit_block(c) for _ in range(c.n_layers))
        self.norm = LayerNorm(d, eps=c.eps)
        self.pooler = None if c.pooler_dim is None else nn.Linear(d, c.pooler_dim)

    def positions(self, grid: tuple[int, int]) -> torch.Tensor:
        """Position embeddings ``(1, 1 + gh·gw, d_model)`` for a ``grid`` of patches: the trained
        ones, or bicubically resized patch positions (class position unchanged), as DINO and
        transformers' ``interpolate_pos_encoding`` do."""
        if tuple(grid) == self.config.grid:
            return self.pos_embed
        gh0, gw0 = self.config.grid
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        patch_pos = patch_pos.reshape(1, gh0, gw0, -1).permute(0, 3, 1, 2)  # -> (1, d, gh0, gw0)
        patch_pos = F.interpolate(patch_pos, size=grid, mode="bicubic", align_corners=False)
        patch_pos = patch_pos.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)
        return torch.cat([cls_pos, patch_pos], dim=1)

    def forward(self, pixel_values: torch.Tensor, *, interpolate_pos_encoding: bool = False):
        """``pixel_values (B, C, H, W)``; other sizes than the config's need
        ``interpolate_pos_encoding=True`` (sides still multiples of the patch)."""
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1] != c.num_channels:
            raise ValueError(
                f"pixel_values must be (B, C={c.num_channels}, H, W), got shape "
                f"{tuple(pixel_values.shape)}"
            )
        size = tuple(pixel_values.shape[2:])
        if size != c.image_size and not interpolate_pos_encoding:
            raise ValueError(
                f"image size {size} does not match the model's {c.image_size}; resize the "
                "images or pass interpolate_pos_encoding=True"
            )
        if any(s % p for s, p in zip(size, c.patch_size)):
            raise ValueError(f"image size {size} must be a multiple of the patch {c.patch_size}")
        x = self.patch_embed(pixel_values)  # (B, C, H, W) -> (B, d, gh, gw)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)  # (B, d, gh, gw) -> (B, gh·gw, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # -> (B, 1 + P, d)
        x = self.dropout(x + self.positions(grid))
        for block in self.blocks:
            x = block(x)  # bidirectional: no mask
        x = self.norm(x)
        pooled = None
        if self.pooler is not None:
            pooled = ACTIVATIONS[c.pooler_activation](self.pooler(x[:, 0]))
        return ViTOutput(x, pooled)

    @classmethod
    def from_config(cls, config: dict) -> ViT:
        """A transformers ``ViTConfig`` dict (``ViTModel`` only: the bare encoder with pooler)."""
        archs = config.get("architectures") or ["ViTModel"]
        if archs != ["ViTModel"]:
            raise unsupported(config, "architectures", "only ViTModel (encoder + pooler) is built")
        for key in ("hidden_act", "pooler_act"):
            if config.get(key, "gelu" if key == "hidden_act" else "tanh") not in ACTIVATIONS:
                raise unsupported(config, key, f"known activations are {sorted(ACTIVATIONS)}")
        d = config.get("hidden_size", 768)
        return cls(
            ViTConfig(
                image_size=_pair(config.get("image_size", 224)),
                patch_size=_pair(config.get("patch_size", 16)),
                num_channels=config.get("num_channels", 3),
                d_model=d,
                n_layers=config.get("num_hidden_layers", 12),
                n_heads=config.get("num_attention_heads", 12),
                d_hidden=config.get("intermediate_size", 3072),
                activation=config.get("hidden_act", "gelu"),
                eps=config.get("layer_norm_eps", 1e-12),
                qkv_bias=config.get("qkv_bias", True),
                pooler_dim=config.get("pooler_output_size") or d,
                pooler_activation=config.get("pooler_act", "tanh"),
                dropout=config.get("hidden_dropout_prob", 0.0),
                attention_dropout=config.get("attention_probs_dropout_prob", 0.0),
            )
        )

    @staticmethod
    def convert_hf_state_dict(state: dict) -> dict:
        """transformers ViTModel names -> ours (unknown names pass through, so that loading
        reports them)."""
        out = {}
        for name, t in state.items():
            new = name
            for old, ours in _TOP_NAMES.items():
                if name.startswith(old + ".") or name == old:
                    new = ours + name[len(old) :]
            for prefix in ("encoder.layer.", "layers."):  # saved names, v5's module names
                if name.startswith(prefix):
                    i, rest = name[len(prefix) :].split(".", 1)
                    for old, ours in _LAYER_NAMES.items():
                        if rest.startswith(old + "."):
                            new = f"blocks.{i}.{ours}{rest[len(old) :]}"
                            break
            out[new] = t
        return out


# ---------------------------------------------------------------------------------------------
# Swin-style shifted-window attention
# ---------------------------------------------------------------------------------------------


class WindowLayout(NamedTuple):
    """Window-major token order of an ``(H, W)`` patch grid (all ``(S,)`` int64, ``S = H·W``).

    Slot ``t`` holds the raster token ``order[t]``; ``ids[t]`` is its window group
    (non-decreasing); ``rows[t], cols[t]`` its coordinates in the shifted frame.
    """

    order: torch.Tensor
    ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def window_layout(height: int, width: int, window: int, shift: int = 0, device=None):
    """The :class:`WindowLayout` of Swin's (shifted) windows.

    Swin shifts the grid cyclically by ``-shift`` (``torch.roll``) and cuts it into ``window ×
    window`` windows; a window that wraps around the border holds patches that are not neighbours
    in the image, so Swin masks the pairs from different *regions* of it (its ``img_mask``: the
    last ``shift`` rows and columns of the shifted frame form their own regions). Here a token's
    group is (window, row region, column region) and two tokens attend iff their groups are equal:
    exactly Swin's cyclic-shift attention. Sorting the tokens by group puts each group in
    consecutive slots, so the attention mask is block diagonal and a tile of the chunked backend
    meets only a few groups: the cost is linear in the number of patches.
    """
    r = torch.arange(height, device=device).view(-1, 1).expand(height, width)
    c = torch.arange(width, device=device).view(1, -1).expand(height, width)
    window_id = (r // window) * (width // window) + c // window
    if shift:  # the wrapped-around strip of the last window row / column is a region of its own
        region = (r >= height - shift).long() * 2 + (c >= width - shift).long()
    else:
        region = torch.zeros_like(r)
    ids, slots = (window_id * 4 + region).flatten().sort(stable=True)
    source = ((r + shift) % height) * width + (c + shift) % width  # the roll by -shift
    return WindowLayout(source.flatten()[slots], ids, r.flatten()[slots], c.flatten()[slots])


class WindowBias(ScoreMod):
    """Swin's relative position bias: ``table[(Δr + w - 1)·(2w - 1) + Δc + w - 1, h]`` with
    ``Δr, Δc`` the query-minus-key offsets in the window; ``table ((2w - 1)², Hq)`` learns.

    ``rows, cols (S,)``: each token's coordinates (any frame where a window is ``w × w``). Pairs
    from different windows (masked anyway) read a clamped entry.
    """

    additive = True

    def __init__(self, table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, window: int):
        self.table, self.rows, self.cols, self.window = table, rows, cols, window

    def bias(self, b, h, q_idx, kv_idx):
        w = self.window
        rows, cols = self.rows.to(q_idx.device), self.cols.to(q_idx.device)
        dr = (rows[q_idx] - rows[kv_idx] + w - 1).clamp(0, 2 * w - 2)
        dc = (cols[q_idx] - cols[kv_idx] + w - 1).clamp(0, 2 * w - 2)
        return self.table[dr * (2 * w - 1) + dc, h]  # -> (…, Hq, Sq, Sk) by broadcasting

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx).to(score.dtype)

    def tensors(self):
        return (self.table,)

    def validate(self, B, H, Sq, Sk, q_offset):
        if Sk != self.rows.numel() or H != self.table.shape[1]:
            raise ValueError(
                f"window bias is for {self.rows.numel()} tokens and {self.table.shape[1]} heads, "
                f"the call has Sk={Sk} and Hq={H}"
            )

    def __repr__(self) -> str:
        return f"WindowBias(window={self.window}, heads={self.table.shape[1]})"


class SwinBlock(nn.Module):
    """A Swin transformer block: pre-norm (shifted-)window attention, then an MLP.

    ``x (B, H, W, C)`` patch grid -> ``(B, H, W, C)``; ``H`` and ``W`` multiples of ``window``,
    ``0 <= shift < window`` (Swin alternates ``shift = 0`` and ``window // 2``). Inside, the
    tokens are put in window-major order (:func:`window_layout`), attention runs once over the
    whole sequence with ``masks.documents(group ids)`` (same window, same Swin region) and a
    :class:`WindowBias`, and the result is put back in raster order. Equal to Swin's cyclic shift
    + window partition + per-window softmax (its ``-100`` mask is an exact ``-inf`` here).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        window: int,
        shift: int = 0,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        eps: float = 1e-5,
        backend: str = "auto",
    ):
        super().__init__()
        positive_int(window, "window")
        if not 0 <= shift < window:
            raise ValueError(f"shift must be in [0, window={window}), got {shift}")
        self.window, self.shift = window, shift
        self.block = EncoderBlock(
            MultiHeadAttention(dim, n_heads, bias=qkv_bias, out_bias=True, backend=backend),
            MLP(dim, int(dim * mlp_ratio)),
            LayerNorm(dim, eps=eps),
            LayerNorm(dim, eps=eps),
            norm_first=True,
        )
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * window - 1) ** 2, n_heads) * 0.02
        )

    def mask_and_bias(self, height: int, width: int, device=None):
        """``(layout, mask, score_mod)`` of an ``(height, width)`` grid, in window-major order."""
        w = self.window
        if height % w or width % w:
            raise ValueError(
                f"grid ({height}, {width}) must be a multiple of window={w} on both sides; "
                "pad the patch grid"
            )
        lay = window_layout(height, width, w, self.shift, device)
        bias = WindowBias(self.relative_position_bias_table, lay.rows, lay.cols, w)
        return lay, masks.documents(lay.ids), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"x must be a patch grid (B, H, W, C), got shape {tuple(x.shape)}")
        B, H, W, C = x.shape
        lay, mask, bias = self.mask_and_bias(H, W, x.device)
        t = x.reshape(B, H * W, C)[:, lay.order]  # (B, H, W, C) -> (B, S, C) window-major
        t = self.block(t, mask=mask, score_mod=bias)
        t = t[:, torch.argsort(lay.order)]  # window-major -> raster
        return t.view(B, H, W, C)
