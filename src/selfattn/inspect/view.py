"""``write_view``: captured attention as one self-contained, interactive HTML page.

The page (``view.html`` beside this module, plain JavaScript, inline CSS, SVG and canvas; no
network, works from ``file://``) holds a head view (tokens on both sides, one line per weight
above a threshold, heads selectable by colour), a model view (layers x heads thumbnails; a click
opens one), a matrix view with the value under the pointer and, beside it, the picture of what
the call's mask allowed, a switch between raw weights, rollout and attention x gradient, a patch
grid for vision models and one section per kind of attention (encoder, decoder, cross). A
causal LM's page may add a "circuits" tab (:func:`circuits_section`): the heads' induction,
previous-token and copying scores, the activation-patching heatmap, the ablation of the top
induction heads against random heads, and the logit lens of the page's text.

Data is embedded as JSON: each map rounded to ``decimals`` (3 by default) as int16 codes
``round(x · 10^decimals)``, zigzag-coded, split into a low-byte and a high-byte plane (the high
plane of weights in [0, 1] is almost all zeros), gzip-compressed and base64-encoded; the browser
inflates it with ``DecompressionStream``. A 12 x 12 x 256-token model is ~9.4M weights.

>>> with capture_attention(model) as maps:                              # doctest: +SKIP
...     model(ids)
>>> write_view(maps, tokens, "attention.html")                          # doctest: +SKIP
"""

from __future__ import annotations

import base64
import gzip
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfattn.inspect.attribution import attention_rollout
from selfattn.inspect.capture import AttentionMaps

if TYPE_CHECKING:
    from selfattn.inspect.circuits import InductionReport, LogitLens, Patching

__all__ = ["circuits_section", "view_section", "write_view"]

TEMPLATE = "view.html"
_DATA_MARK = "/*__SELFATTN_DATA__*/null"
MAX_DECIMALS = 4  # 10^4 codes still fit int16 with a sign; more would not
_IMAGE_TYPES = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg"}


def _encode(x: torch.Tensor, decimals: int) -> str:
    """``x`` (values in [-1, 1] after scaling) -> base64 of gzip(low plane + high plane)."""
    codes = torch.round(x.detach().double().cpu() * 10**decimals).to(torch.int32).flatten()
    zig = ((codes << 1) ^ (codes >> 31)).to(torch.int32)  # zigzag: small magnitudes, small codes
    low, high = (zig & 0xFF).to(torch.uint8), ((zig >> 8) & 0xFF).to(torch.uint8)
    raw = torch.cat([low, high]).numpy().tobytes()
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def _layer_maps(maps, layers) -> tuple[list[int], list[str], list[torch.Tensor], list[int]]:
    """``(layer ids, labels, (B, H, Sq, Sk) maps, head ids)`` of the selected layers."""
    if isinstance(maps, AttentionMaps):
        ids = [i for i in maps if layers is None or i in layers]
        return ids, [f"{i}: {maps.names[i]}" for i in ids], [maps[i] for i in ids], maps.heads
    if isinstance(maps, torch.Tensor):
        if maps.dim() == 4:
            maps = maps.unsqueeze(1)  # (L, H, Sq, Sk) -> (L, 1, H, Sq, Sk)
        if maps.dim() != 5:
            raise ValueError(
                f"maps must be (L, B, H, Sq, Sk) or (L, H, Sq, Sk), got {tuple(maps.shape)}"
            )
        maps = dict(enumerate(maps))
    if not isinstance(maps, Mapping):
        raise TypeError(
            "maps must be AttentionMaps, a dict layer -> (B, H, Sq, Sk), a tensor "
            f"(L, B, H, Sq, Sk) or a list of view_section(...) dicts, got {type(maps).__name__}"
        )
    ids = [i for i in sorted(maps) if layers is None or i in layers]
    ws = [maps[i] for i in ids]
    heads = list(range(ws[0].shape[1])) if ws else []
    return ids, [str(i) for i in ids], ws, heads


def _image_url(image) -> str | None:
    """A ``data:`` URL of a PNG/JPEG file or bytes (the picture under a ViT's patch grid)."""
    if image is None:
        return None
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    kind = next((t for magic, t in _IMAGE_TYPES.items() if data.startswith(magic)), None)
    if kind is None:
        raise ValueError("image must be a PNG or JPEG file (or its bytes)")
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def view_section(
    maps,
    tokens: Sequence[str],
    *,
    key_tokens: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    name: str = "self-attention",
    batch: int = 0,
    rollout: bool = True,
    gradients: bool = True,
    grid: tuple[int, int] | None = None,
    prefix: int = 0,
    image=None,
    decimals: int = 3,
) -> dict:
    """One section of a page: the maps of ``layers`` (default all) for sequence ``batch``.

    Args:
        maps: :class:`AttentionMaps`, a dict ``layer -> (B, H, Sq, Sk)`` or a tensor
            ``(L, B, H, Sq, Sk)``; all selected layers must share ``(Sq, Sk)``.
        tokens: the query tokens (``Sq`` of them, or fewer: the first rows, e.g. without
            right padding); ``key_tokens`` the keys (default ``tokens``: self-attention).
        rollout: add attention rollout where it exists (square maps of every head).
        gradients: add attention x gradient where ``maps`` recorded gradients
            (:func:`~selfattn.inspect.attention_gradients`), each head scaled by its largest
            ``|A ⊙ ∂y/∂A|`` so it reads in [-1, 1].
        grid: ``(rows, cols)`` of image patches (ViT): the keys after the first ``prefix``
            (class token) tokens form that grid; ``image`` (a PNG/JPEG path or bytes) lies
            under it.
        decimals: rounding of the embedded values (the page shows exactly these), 1 to 4.
    """
    if not 1 <= decimals <= MAX_DECIMALS:
        raise ValueError(f"decimals must be 1..{MAX_DECIMALS} (int16 codes), got {decimals}")
    ids, labels, ws, heads = _layer_maps(maps, None if layers is None else set(layers))
    if not ws:
        raise ValueError("no maps to show: capture some layers (call the model inside `with`)")
    queries = [str(t) for t in tokens]
    keys = queries if key_tokens is None else [str(t) for t in key_tokens]
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) > 1:
        raise ValueError(
            f"layers {ids} have maps of different shapes {sorted(shapes)}: one section shows "
            "one kind of attention; pass layers=[...] per section (encoder, decoder, cross) "
            "and write_view a list of view_section(...) dicts"
        )
    B, _, Sq, Sk = shapes.pop()
    if not 0 <= batch < B:
        raise ValueError(f"batch {batch} is out of range: the maps hold B={B} sequences")
    if not 0 < len(queries) <= Sq or not 0 < len(keys) <= Sk:
        raise ValueError(
            f"{len(queries)} query token(s) and {len(keys)} key token(s) for maps of Sq={Sq}, "
            f"Sk={Sk}; pass the tokens of the captured sequence (key_tokens= for cross-attention)"
        )
    Sq, Sk = len(queries), len(keys)
    if grid is not None and (len(grid) != 2 or prefix + grid[0] * grid[1] != Sk):
        raise ValueError(
            f"grid {tuple(grid)} with prefix={prefix} covers {prefix} + rows·cols keys, but the "
            f"maps have Sk={Sk}; pass the patch grid (image side / patch side) of the model"
        )
    w = torch.stack([x[batch, :, :Sq, :Sk] for x in ws])  # (L, H, Sq, Sk)
    kinds = {"weights": {"heads": heads, "data": _encode(w, decimals), "signed": False}}
    every_head = not isinstance(maps, AttentionMaps) or all(
        len(heads) == maps.modules[i].n_heads for i in ids
    )
    if rollout and Sq == Sk and every_head:
        r = attention_rollout(w.unsqueeze(1))  # (L, 1, H, S, S) -> (L, 1, S, S)
        kinds["rollout"] = {"heads": ["all"], "data": _encode(r, decimals), "signed": False}
    if gradients and isinstance(maps, AttentionMaps) and maps.record_gradients:
        g = torch.stack([maps.times_gradient(i)[batch, :, :Sq, :Sk] for i in ids]).double()
        g = g / g.abs().amax((-2, -1), keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
        kinds["gradient"] = {"heads": heads, "data": _encode(g, decimals), "signed": True}
    allowed = None
    if isinstance(maps, AttentionMaps):
        got = [maps.mask(i) for i in ids]
        if any(m is not None for m in got):
            full = torch.ones(1, Sq, Sk, dtype=torch.bool)
            allowed = torch.stack(
                [full if m is None else m[batch, :1, :Sq, :Sk].cpu() for m in got]
            )  # (L, 1, Sq, Sk): the first captured head's (masks rarely differ per head)
    return {
        "name": name,
        "queries": queries,
        "keys": keys,
        "layers": labels,
        "scale": 10**decimals,
        "kinds": kinds,
        "mask": None if allowed is None else _encode(allowed.to(torch.int32), 0),
        "grid": None if grid is None else {"rows": grid[0], "cols": grid[1], "prefix": prefix},
        "image": _image_url(image),
    }


def _rounded(x, decimals: int):
    """Numbers (a tensor, float or nested list) rounded to ``decimals``; NaN and inf -> None."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _rounded(v, decimals) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, decimals) for v in x]
    if isinstance(x, bool) or not isinstance(x, float):
        return x
    return round(x, decimals) if math.isfinite(x) else None


def circuits_section(
    report: InductionReport | None = None,
    patching: Patching | None = None,
    lens: LogitLens | None = None,
    *,
    tokens: Sequence[str] | None = None,
    tokenizer=None,
    clean: str | None = None,
    corrupted: str | None = None,
    metric: str | None = None,
    threshold: float = 0.3,
    batch: int = 0,
    decimals: int = 3,
) -> dict:
    """The page's "circuits" tab (``write_view(..., circuits=...)``) from the analyses of
    :mod:`selfattn.inspect.circuits`, each optional, every number rounded to ``decimals``.

    Args:
        report: :func:`~selfattn.inspect.circuits.induction_heads`: the table of heads by
            induction score (those ``>= threshold`` marked) and, with ``ablate=k``, the
            repeated-half loss with the top-k heads against ``k`` random heads ablated.
        patching: :func:`~selfattn.inspect.circuits.activation_patching`: the heatmap of
            restored shares (blocks x heads, or blocks x positions labelled by ``tokens``);
            ``clean``, ``corrupted`` and ``metric`` name its prompts and metric above it.
        lens: :func:`~selfattn.inspect.circuits.logit_lens` of sequence ``batch``: layers x
            positions (``tokens``), each cell its top tokens (decoded by ``tokenizer``, else ids)
            and their probabilities.
    """
    if report is None and patching is None and lens is None:
        raise ValueError("circuits_section needs at least one of report, patching and lens")
    if not 1 <= decimals <= MAX_DECIMALS:
        raise ValueError(f"decimals must be 1..{MAX_DECIMALS}, got {decimals}")
    spans = []  # (what, positions) that ``tokens`` labels
    if patching is not None and patching.over == "positions":
        spans.append(("patching over positions", patching.effect.shape[1]))
    if lens is not None:
        spans.append(("logit lens", lens.top_ids.shape[2]))
    for what, n in spans:
        if tokens is not None and len(tokens) != n:
            raise ValueError(
                f"{len(tokens)} token(s) for a {what} of {n} positions; pass the tokens of the "
                "analysed text"
            )
    out: dict = {"decimals": decimals, "heads": None, "ablation": None, "patching": None,
                 "lens": None}  # fmt: skip
    if report is not None:
        keys = ("layer", "head", "induction", "prev_token", "copying", "is_induction")
        out["heads"] = {
            "threshold": threshold,
            "rows": [[r[k] for k in keys] for r in report.table(threshold=threshold)],
            "loss_first": report.loss_first,
            "loss_repeated": report.loss_repeated,
        }
        out["ablation"] = report.ablation or None
    if patching is not None:
        labels = [f"h{j}" for j in range(patching.effect.shape[1])]
        if patching.over == "positions" and tokens is not None:
            labels = [str(t) for t in tokens]
        out["patching"] = {
            "over": patching.over,
            "columns": labels,
            "effect": patching.effect,
            "patched": patching.patched,
            "clean": patching.clean,
            "corrupted": patching.corrupted,
            "clean_text": clean,
            "corrupted_text": corrupted,
            "metric": metric,
        }
    if lens is not None:
        out["lens"] = {
            "tokens": None if tokens is None else [str(t) for t in tokens],
            "layers": lens.as_json(tokenizer, batch=batch),
        }
    return _rounded(out, decimals)


def write_view(
    maps, tokens, path, *, title: str = "selfattn: attention", circuits: dict | None = None,
    **section,
) -> Path:  # fmt: skip
    """Write the page for ``maps`` over ``tokens`` to ``path`` (keywords: :func:`view_section`),
    or, with ``maps`` a list of :func:`view_section` dicts and ``tokens=None``, a page with one
    selectable section each (e.g. encoder, decoder and cross-attention of a seq2seq model).
    ``circuits``: a :func:`circuits_section` dict, shown in a tab of its own."""
    if isinstance(maps, list) and all(isinstance(s, dict) for s in maps):
        if tokens is not None or section:
            raise ValueError("with a list of sections, pass tokens=None and no section keywords")
        sections = maps
    else:
        sections = [view_section(maps, tokens, **section)]
    template = resources.files("selfattn.inspect").joinpath(TEMPLATE).read_text("utf-8")
    page = {"title": title, "sections": sections, "circuits": circuits}
    data = json.dumps(page, separators=(",", ":"), allow_nan=False)
    # inside <script>: "</script>" or "<!--" in a token must not end the script
    data = data.replace("<", "\\u003c")
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"cannot write {str(path)!r}: the page's name must end in .html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(template.replace(_DATA_MARK, data), encoding="utf-8")
    return path
