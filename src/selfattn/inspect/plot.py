"""Heatmaps of attention weights and masks (matplotlib, PNG or SVG, no display needed).

The picture follows the usual convention: rows = queries, columns = keys, each row sums to 1;
masked pairs are grey (their score was ``-inf``). Figures are built with
``matplotlib.figure.Figure`` directly, never pyplot, so plotting changes no global state and works
without a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from selfattn import masks as _masks
from selfattn._optional import require
from selfattn._validate import positive_int

__all__ = [
    "mask_figure_bytes",
    "plot_attention",
    "plot_mask",
    "plot_patching",
]

_FORMATS = (".png", ".svg")
# Beyond these a panel's numbers are unreadable: colour only.
_ANNOTATE_MAX_CELLS, _ANNOTATE_MAX_PANELS = 16 * 16, 4
_MASKED = "#d9d9d9"  # grey for masked pairs
_ROW_NOTE = "rows = queries, columns = keys; each row sums to 1"


_DPI = 100  # pixels per inch of the written pictures


def _mask_side(Sq: int, Sk: int) -> float:
    """Side in inches of :func:`plot_mask`'s square figure: a quarter inch per position."""
    return max(3.0, 0.25 * max(Sq, Sk) + 1.0)


def mask_figure_bytes(Sq: int, Sk: int) -> int:
    """Bytes of the RGBA canvas :func:`plot_mask` renders for an ``(Sq, Sk)`` mask."""
    pixels = math.ceil(_mask_side(Sq, Sk) * _DPI)
    return pixels * pixels * 4


def _figure(n_rows: int, n_cols: int, cell_inches: float, **kwargs):
    Figure = require("matplotlib.figure", purpose="plotting").Figure

    kwargs.setdefault("figsize", (n_cols * cell_inches, n_rows * cell_inches))
    return Figure(**kwargs)


def _save(fig, out) -> None:
    if out is None:
        return
    path = Path(out)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(
            f"cannot write {str(path)!r}: the file name must end in .png or .svg, "
            f"got {path.suffix or 'no suffix'!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)


def _as_panels(weights) -> torch.Tensor:
    """``(Sq, Sk)``, ``(H, Sq, Sk)`` or ``(1, H, Sq, Sk)`` -> float ``(H, Sq, Sk)`` on the CPU."""
    w = torch.as_tensor(weights).detach()
    if w.dim() == 4:
        if w.shape[0] != 1:
            raise ValueError(
                f"weights (B={w.shape[0]}, H, Sq, Sk) hold {w.shape[0]} sequences; pick one, "
                "e.g. weights[b] -> (H, Sq, Sk)"
            )
        w = w[0]
    if w.dim() == 2:
        w = w.unsqueeze(0)  # (Sq, Sk) -> (1, Sq, Sk)
    if w.dim() != 3:
        raise ValueError(
            f"weights must be (Sq, Sk), (H, Sq, Sk) or (1, H, Sq, Sk), got {tuple(w.shape)}"
        )
    return w.float().cpu()


def _labels(tokens, n: int, what: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(
            f"{len(tokens)} {what} labels for {n} {what}s; pass one label per {what} "
            f"(tokens for queries, key_tokens for keys when Sq != Sk)"
        )
    return tokens


def _dense_mask(mask, Sq: int, Sk: int, q_offset) -> torch.Tensor | None:
    """Bool ``(Sq, Sk)`` (True = attend) for ``mask``: a ``Mask``, callable or bool tensor."""
    if mask is None:
        return None
    m = _masks.as_mask(mask)
    return m.to_dense(Sq, Sk, q_offset=q_offset)[0, 0].cpu()


def plot_attention(
    weights,
    tokens: Sequence[str] | None = None,
    *,
    key_tokens: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    title: str | None = None,
    mask=None,
    q_offset: int | None = None,
    annotate: bool | None = None,
    cols: int | None = None,
    out=None,
):
    """Heatmaps of attention weights, one panel per head, with token labels on both axes.

    Args:
        weights: ``(Sq, Sk)`` for one map, ``(H, Sq, Sk)`` (or ``(1, H, Sq, Sk)``) for a grid of
            heads; e.g. ``maps[layer][b]`` from :func:`capture_attention`.
        tokens: ``Sq`` query labels (the y axis); also the key labels when ``Sq == Sk``.
        key_tokens: ``Sk`` key labels (the x axis) when they differ from ``tokens``.
        titles: one title per panel (default ``head 0``, ``head 1``, ...); ``title``: the figure's.
        mask: the mask the weights were computed with (a ``selfattn.masks.Mask``, mask_mod or bool
            ``(Sq, Sk)``, True = attend); masked pairs are drawn grey and labelled ``-inf``.
        q_offset: absolute position of query row 0 for ``mask`` (default ``Sk - Sq``).
        annotate: write each weight in its cell (default: up to 4 panels of at most 16 x 16).
        cols: panels per row of the grid (default up to 4).
        out: a ``.png`` or ``.svg`` path to write (folders are created).

    Returns:
        the ``matplotlib.figure.Figure``.
    """
    w = _as_panels(weights)
    H, Sq, Sk = w.shape
    ys = _labels(tokens, Sq, "query")
    if key_tokens is None and tokens is not None and Sq != Sk:
        raise ValueError(f"Sq={Sq} != Sk={Sk}: pass key_tokens, the {Sk} key labels")
    xs = _labels(key_tokens if key_tokens is not None else tokens, Sk, "key")
    titles = [f"head {h}" for h in range(H)] if titles is None else list(titles)
    if len(titles) != H:
        raise ValueError(f"{len(titles)} titles for {H} panels; pass one title per head")
    allowed = _dense_mask(mask, Sq, Sk, q_offset)
    if annotate is None:  # numbers only where they stay readable
        annotate = Sq * Sk <= _ANNOTATE_MAX_CELLS and H <= _ANNOTATE_MAX_PANELS
    cols = min(H, 4) if cols is None else cols
    positive_int(cols, "cols")
    rows = math.ceil(H / cols)
    # Fixed margins in inches (a layout engine would measure every label: most of the time).
    side = max(2.0, 0.2 * max(Sq, Sk))  # one panel
    label = 0.07 * max(len(t) for t in xs + ys) + 0.45  # token labels + "key"/"query"
    right, top, gap = 1.1, 0.75, 0.35  # colour bar; suptitle; panel titles
    width, height = cols * side + label + right, rows * (side + gap) + label + top
    fig = _figure(1, 1, 1.0, figsize=(width, height))
    fig.subplots_adjust(
        left=label / width,
        right=1 - right / width,
        bottom=label / height,
        top=1 - top / height,
        wspace=0.05,
        hspace=gap / side,
    )
    # Shared axes: tokens label the outer panels only (text layout dominates the drawing time).
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= H:
            ax.set_axis_off()
            continue
        bottom, left = i + cols >= H, i % cols == 0  # nothing below / the first column
        panel = w[i].numpy()
        if allowed is not None:
            panel = panel.copy()
            panel[~allowed.numpy()] = float("nan")  # drawn in the "bad" colour: grey
        image = ax.imshow(panel, cmap=_cmap(), vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(titles[i], fontsize=9)
        ax.set_xticks(range(Sk), xs, rotation=90, fontsize=7)
        ax.set_yticks(range(Sq), ys, fontsize=7)
        ax.tick_params(labelbottom=bottom, labelleft=left)
        if bottom:
            ax.set_xlabel("key", fontsize=8)
        if left:
            ax.set_ylabel("query", fontsize=8)
        if annotate:
            for r in range(Sq):
                for c in range(Sk):
                    masked = allowed is not None and not bool(allowed[r, c])
                    text = "-inf" if masked else f"{w[i, r, c].item():.2f}"
                    colour = "black" if masked or w[i, r, c] < 0.6 else "white"
                    ax.text(c, r, text, ha="center", va="center", fontsize=6, color=colour)
    if image is not None:
        bar = fig.add_axes([1 - 0.8 / width, 0.25, 0.15 / width, 0.5])
        fig.colorbar(image, cax=bar, label="attention weight")
    fig.suptitle(f"{title}\n{_ROW_NOTE}" if title else _ROW_NOTE, fontsize=10)
    _save(fig, out)
    return fig


def _cmap():
    matplotlib = require("matplotlib", purpose="plotting")
    return matplotlib.colormaps["viridis"].with_extremes(bad=_MASKED)


def plot_mask(
    mask,
    size: int,
    *,
    kv_size: int | None = None,
    q_offset: int | None = None,
    title: str | None = None,
    out=None,
):
    """Draw which (query, key) pairs a mask allows: blue = attend, white = masked.

    Args:
        mask: a ``selfattn.masks.Mask``, a mask_mod callable, a bool ``(Sq, Sk)`` tensor, or a
            mask expression such as ``"causal & sliding_window(3)"`` (see
            :func:`selfattn.inspect.parse_mask`).
        size: ``Sq`` (and ``Sk`` unless ``kv_size`` is given); ``q_offset`` as in
            :meth:`Mask.to_dense` (default ``Sk - Sq``).
        out: a ``.png`` or ``.svg`` path to write.

    Returns:
        the ``matplotlib.figure.Figure``.
    """
    from selfattn.inspect.mask_expr import parse_mask

    ListedColormap = require("matplotlib.colors", purpose="plot_mask").ListedColormap

    expr = mask if isinstance(mask, str) else None
    m = parse_mask(mask) if expr is not None else _masks.as_mask(mask)
    for name, n in (("size", size), ("kv_size", kv_size)):
        if n is not None:
            positive_int(n, name)
    Sq, Sk = size, size if kv_size is None else kv_size
    dense = m.to_dense(Sq, Sk, q_offset=q_offset)[0, 0].cpu()  # (Sq, Sk) bool
    fig = _figure(1, 1, _mask_side(Sq, Sk), layout="constrained")
    ax = fig.subplots()
    ax.imshow(dense.float().numpy(), cmap=ListedColormap(["white", "#3b6fb6"]), vmin=0, vmax=1)
    step = max(1, math.ceil(max(Sq, Sk) / 32))  # at most ~32 tick labels per axis
    ax.set_xticks(range(0, Sk, step))
    ax.set_yticks(range(0, Sq, step))
    ax.set_xticks([x - 0.5 for x in range(Sk + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(Sq + 1)], minor=True)
    ax.grid(which="minor", color="#bbbbbb", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position (row)")
    allowed = int(dense.sum())
    heading = title or expr or repr(m)
    ax.set_title(f"{heading}\n{allowed} of {Sq * Sk} pairs attend", fontsize=10)
    _save(fig, out)
    return fig


def plot_patching(patching, *, tokens: Sequence[str] | None = None, title: str | None = None,
                  out=None):  # fmt: skip
    """Heatmap of an activation-patching result (:class:`~selfattn.inspect.circuits.Patching`):
    blocks down, heads (or positions, labelled by ``tokens``) across, colour the restored share
    of the clean metric (1: the patch restores it, 0: no effect; red above 0, blue below).

    Returns:
        the ``matplotlib.figure.Figure``; ``out`` a ``.png`` or ``.svg`` path to write.
    """
    effect = patching.effect.detach().double().cpu()
    L, J = effect.shape
    fig = _figure(1, 1, 1.0, figsize=(max(4.0, 0.45 * J + 2.0), max(3.0, 0.3 * L + 1.5)),
                  layout="constrained")  # fmt: skip
    ax = fig.subplots()
    lim = max(1.0, float(effect.nan_to_num(0).abs().max()))
    cmap = require("matplotlib", purpose="plotting").colormaps["RdBu_r"].with_extremes(bad=_MASKED)
    image = ax.imshow(effect.numpy(), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    over = "head" if patching.over == "heads" else "position"
    ax.set_xlabel(over)
    ax.set_ylabel("block")
    if tokens is not None and patching.over == "positions":
        ax.set_xticks(range(J), _labels(tokens, J, "position"), rotation=90, fontsize=8)
    fig.colorbar(image, ax=ax, label="restored share of the clean metric")
    head = title or f"activation patching by {over}"
    ax.set_title(f"{head}\nclean {patching.clean:.3g}, corrupted {patching.corrupted:.3g}",
                 fontsize=10)  # fmt: skip
    _save(fig, out)
    return fig
