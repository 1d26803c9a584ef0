"""The built-in masks: causal, sliding window, chunked, padding, documents, prefix-LM and
block-sparse. Each classifies tiles analytically (O(tiles)) and, where it is one key interval per
query row, says so through :meth:`~selfattn.masks.Mask.key_interval`.
"""

from __future__ import annotations

import torch

from selfattn.masks.base import Mask
from selfattn.masks.tiles import KEY_UNBOUNDED, check_positive_int, kinds_from, tile_min_max

# Above this many (tile pair × distinct id) products, documents() with unsorted ids falls back
# from the exact set-intersection test to the (sound, looser) id-interval test.
_DOCUMENTS_EXACT_BUDGET = 1 << 24


def _as_index_tensor(x, name: str, device=None) -> torch.Tensor:
    """Integer tensor (int64) from a tensor, list or number; bool/float/complex raise TypeError."""
    if not isinstance(x, torch.Tensor) and isinstance(x, (list, tuple)) and len(x) == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integers, got dtype {t.dtype} ({_preview(t)}); "
            "convert with .long() after rounding"
        )
    return t.long()


def _preview(t: torch.Tensor, n: int = 8) -> str:
    """A short text of a tensor's values for error messages."""
    flat = t.detach().flatten()
    vals = flat[:n].tolist()
    more = ", ..." if flat.numel() > n else ""
    return f"values {vals}{more}" if t.dim() else f"value {t.item()}"


# ----------------------------------------------------------------------------------------------
# Built-in masks. Each tile rule below is exact: a tile covers the positions
# [qf, ql] × [kf, kl] (all integer pairs in that rectangle), and the conditions are the
# "for all pairs" (FULL) and "for no pair" (EMPTY) versions of the mask's formula.
# ----------------------------------------------------------------------------------------------


class Causal(Mask):
    """Key ``j`` is visible from query position ``i`` when ``j <= i``."""

    def mask_mod(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    relative = True
    is_causal = True

    def tile_kinds(self, grid, B=1, H=1):
        return kinds_from(grid.kv_last() <= grid.q_first(), grid.kv_first() > grid.q_last())

    def key_interval(self, b, q_idx):
        return torch.full_like(q_idx, -KEY_UNBOUNDED), q_idx + 1

    def __repr__(self) -> str:
        return "causal()"


def causal() -> Mask:
    """Causal mask: query at position ``i`` sees keys ``j <= i`` (bottom-right aligned by default).

    With ``Sq=2, Sk=5`` and the default ``q_offset = Sk - Sq = 3``::

        keys  0 1 2 3 4
        q0    █ █ █ █ ·     (position 3)
        q1    █ █ █ █ █     (position 4)
    """
    return Causal()


class SlidingWindow(Mask):
    def __init__(self, size: int):
        self.size = check_positive_int(
            size, "sliding_window size", "size counts the query's own token: 1 = only itself"
        )

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.size)

    relative = True

    def key_interval(self, b, q_idx):
        return q_idx - self.size + 1, q_idx + 1

    def tile_kinds(self, grid, B=1, H=1):
        # The differences i - j over a tile are the whole interval [qf - kl, ql - kf]; a pair
        # attends iff 0 <= i - j < size.
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        full = (kl <= qf) & (kf > ql - self.size)
        empty = (kf > ql) | (kl <= qf - self.size)
        return kinds_from(full, empty)

    def __repr__(self) -> str:
        return f"sliding_window({self.size})"


def sliding_window(size: int) -> Mask:
    """Causal local window of ``size`` keys, the query's own token included: ``i - size < j <= i``.

    This is the Mistral / transformers convention (flash-attention's ``window_size=(size-1, 0)``).
    ``size=1`` attends only to itself; ``size >= Sk`` equals :func:`causal` under the default
    bottom-right alignment (in general: ``size`` beyond the last query position). With ``size=2``::

        keys  0 1 2 3
        q0    █ · · ·
        q1    █ █ · ·
        q2    · █ █ ·
        q3    · · █ █
    """
    return SlidingWindow(size)


class Chunked(Mask):
    def __init__(self, size: int, causal: bool = True):
        self.size = check_positive_int(size, "chunked size", "it is the chunk length")
        if not isinstance(causal, bool):
            raise TypeError(f"chunked causal must be True or False, got {causal!r}")
        self.causal = causal

    def mask_mod(self, b, h, q_idx, kv_idx):
        same = torch.div(q_idx, self.size, rounding_mode="floor") == torch.div(
            kv_idx, self.size, rounding_mode="floor"
        )
        return same & (kv_idx <= q_idx) if self.causal else same

    def key_interval(self, b, q_idx):
        # the query's own chunk, up to the query itself when causal
        lo = torch.div(q_idx, self.size, rounding_mode="floor") * self.size
        return lo, q_idx + 1 if self.causal else lo + self.size

    def tile_kinds(self, grid, B=1, H=1):
        # Chunk ids of the tile's queries and keys are intervals; with causal=True any chunk the
        # two share holds an attending pair as soon as kf <= ql (take j = max(kf, chunk start),
        # i = min(ql, chunk end)), so the "no pair" test stays exact.
        s = self.size
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        cqf, cql = torch.div(qf, s, rounding_mode="floor"), torch.div(ql, s, rounding_mode="floor")
        ckf, ckl = torch.div(kf, s, rounding_mode="floor"), torch.div(kl, s, rounding_mode="floor")
        full = (cqf == cql) & (ckf == ckl) & (cqf == ckf)
        empty = (cql < ckf) | (ckl < cqf)
        if self.causal:
            full = full & (kl <= qf)
            empty = empty | (kf > ql)
        return kinds_from(full, empty)

    def __repr__(self) -> str:
        return f"chunked({self.size})" if self.causal else f"chunked({self.size}, causal=False)"


def chunked(size: int, causal: bool = True) -> Mask:
    """Local attention in fixed chunks of ``size`` positions (Llama-4's chunked attention).

    Query ``i`` sees key ``j`` when both fall in the same chunk ``⌊i/size⌋ == ⌊j/size⌋`` and, with
    ``causal=True`` (the Llama-4 default), ``j <= i``. ``causal=False`` gives block-diagonal
    bidirectional chunks. Chunks are on absolute positions (chunk 0 is positions ``0..size-1``).
    """
    return Chunked(size, causal)


def _per_batch_values(x, name: str) -> tuple[torch.Tensor, bool]:
    """Non-negative integer values as a 1-D tensor, and whether they are per batch (1-D input)
    rather than one value for every sequence (an int or a 0-d tensor)."""
    t = _as_index_tensor(x, name)
    if t.dim() > 1:
        raise ValueError(
            f"{name} must be an int or a 1-D (B,) tensor, got shape {tuple(t.shape)}; "
            "pass one value per sequence"
        )
    if bool((t < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {_preview(t)}")
    return t.reshape(-1), t.dim() == 1


class Padding(Mask):
    def __init__(self, lengths):
        self.lengths, self.per_batch = _per_batch_values(lengths, "padding lengths")

    def _n(self, b, device) -> torch.Tensor:
        n = self.lengths.to(device)
        return n[b] if self.per_batch else n[0]

    def mask_mod(self, b, h, q_idx, kv_idx):
        return kv_idx < self._n(b, kv_idx.device)

    def key_interval(self, b, q_idx):
        return torch.full_like(q_idx, -KEY_UNBOUNDED), self._n(b, q_idx.device)

    def tile_kinds(self, grid, B=1, H=1):
        n = self.lengths.to(grid.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
        return kinds_from(grid.kv_last() < n, grid.kv_first() >= n)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.per_batch and self.lengths.numel() != B:
            raise ValueError(
                f"padding(lengths) has {self.lengths.numel()} lengths {self.lengths.tolist()} but "
                f"the batch has B={B}; pass one valid-key count per sequence"
            )
        if bool((self.lengths > Sk).any()):
            raise ValueError(
                f"padding lengths {self.lengths.tolist()} exceed the key length Sk={Sk}; "
                "a length counts valid keys, at most Sk"
            )

    def batch_heads(self):
        return (self.lengths.numel() if self.per_batch else 1), 1

    def __repr__(self) -> str:
        n = self.lengths.tolist()
        return f"padding({n if self.per_batch else n[0]})"


def padding(lengths) -> Mask:
    """Key padding: sequence ``b`` has ``lengths[b]`` valid keys ``0 .. lengths[b]-1``.

    ``lengths``: ``(B,)`` ints (tensor or list), or one int for every sequence. Keys at or past the
    length are masked for every query (right padding; left padding is ``~padding(starts)``).
    """
    return Padding(lengths)


class Documents(Mask):
    def __init__(self, ids):
        ids = _as_index_tensor(ids, "documents ids")
        if ids.dim() not in (1, 2):
            raise ValueError(
                f"documents ids must be (S,) or (B, S), got shape {tuple(ids.shape)}; "
                "pass one document id per position"
            )
        self.ids = ids if ids.dim() == 2 else ids.unsqueeze(0)  # (B or 1, S)
        d = self.ids.diff(dim=-1)
        # Sorted ids (the packing case) make the cheap interval test exact (see tile_kinds).
        self._monotone = bool(((d >= 0).all(-1) | (d <= 0).all(-1)).all())

    def mask_mod(self, b, h, q_idx, kv_idx):
        ids = self.ids.to(q_idx.device)
        bi = b if ids.shape[0] > 1 else torch.zeros_like(b)
        return ids[bi, q_idx] == ids[bi, kv_idx]

    def _cover_error(self, first: int, last: int, what: str) -> ValueError:
        return ValueError(
            f"documents ids cover positions 0..{self.ids.shape[1] - 1} but the {what} needs "
            f"positions {first}..{last}; pass one id per position (q_offset >= 0)"
        )

    def _ids_at(self, first: int, count: int, device) -> torch.Tensor:
        """ids of positions ``[first, first + count)``: ``(B', count)``."""
        if count and (first < 0 or first + count > self.ids.shape[1]):
            raise self._cover_error(first, first + count - 1, "tile grid")
        return self.ids.to(device)[:, first : first + count]

    def tile_kinds(self, grid, B=1, H=1):
        dev = grid.device
        qi = self._ids_at(grid.q_offset, grid.Sq, dev)  # (B', Sq)
        ki = self._ids_at(grid.kv_offset, grid.Sk, dev)  # (B', Sk)
        qmin, qmax = tile_min_max(qi, grid.n_q, grid.block_q)  # (B', n_q) each
        kmin, kmax = tile_min_max(ki, grid.n_k, grid.block_k)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        overlap = (qmin <= kmax) & (kmin <= qmax)
        Bi = self.ids.shape[0]
        if self._monotone:
            # Sorted ids: two tiles either share a position or lie apart; apart, the id
            # intervals can only meet at the id of the boundary, which both tiles then hold.
            share = overlap
        else:
            labels = torch.unique(torch.cat([qi, ki], dim=1), return_inverse=True)[1]
            n_ids = int(labels.max()) + 1 if labels.numel() else 1
            if Bi * grid.n_q * grid.n_k * n_ids > _DOCUMENTS_EXACT_BUDGET:
                share = overlap  # sound: an empty intersection is reported as PARTIAL
            else:
                pq = _presence(labels[:, : grid.Sq], grid.n_q, grid.block_q, n_ids)
                pk = _presence(labels[:, grid.Sq :], grid.n_k, grid.block_k, n_ids)
                share = (pq @ pk.transpose(-1, -2) > 0)[:, None]  # (B', 1, n_q, n_k)
        return kinds_from(full, ~share)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.ids.shape[0] not in (1, B):
            raise ValueError(
                f"documents ids have batch {self.ids.shape[0]} (shape {tuple(self.ids.shape)}) "
                f"but the call has B={B}; pass ids of shape (S,) or (B, S)"
            )
        first, last = min(0, q_offset), max(Sk, q_offset + Sq) - 1
        if first < 0 or last >= self.ids.shape[1]:
            raise self._cover_error(first, last, f"call (Sq={Sq}, Sk={Sk}, q_offset={q_offset})")

    def batch_heads(self):
        return self.ids.shape[0], 1

    def kernel_form(self):
        return None, self.ids

    def __repr__(self) -> str:
        return f"documents(<ids {tuple(self.ids.shape)}>)"


def _presence(labels: torch.Tensor, n_tiles: int, block: int, n_ids: int) -> torch.Tensor:
    """float ``(B', n_tiles, n_ids)``: 1 where tile ``t`` holds id label ``l``."""
    Bi, S = labels.shape
    tile = torch.arange(S, device=labels.device) // block
    flat = (tile * n_ids).unsqueeze(0) + labels  # (B', S)
    out = torch.zeros(Bi, n_tiles * n_ids, dtype=torch.float32, device=labels.device)
    out.scatter_(1, flat, 1.0)
    return out.view(Bi, n_tiles, n_ids)


def documents(ids) -> Mask:
    """Packed sequences: attend only within the same document id.

    ``ids``: ``(S,)`` or ``(B, S)`` integer document id per absolute position (``S`` at least
    ``max(Sk, q_offset + Sq)``). Combine with :func:`causal` for packed causal LM training:
    ``causal() & documents(ids)``.
    """
    return Documents(ids)


class PrefixLM(Mask):
    def __init__(self, length):
        self.length, self.per_batch = _per_batch_values(length, "prefix_lm length")

    def mask_mod(self, b, h, q_idx, kv_idx):
        n = self.length.to(kv_idx.device)
        n = n[b] if self.per_batch else n[0]
        return (kv_idx <= q_idx) | (kv_idx < n)

    def key_interval(self, b, q_idx):
        n = self.length.to(q_idx.device)
        n = n[b] if self.per_batch else n[0]
        return torch.full_like(q_idx, -KEY_UNBOUNDED), torch.maximum(q_idx + 1, n)

    def tile_kinds(self, grid, B=1, H=1):
        # attend iff j < max(n, i + 1): full iff kl < max(n, qf + 1), empty iff kf >= max(n, ql + 1)
        n = self.length.to(grid.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        return kinds_from((kl <= qf) | (kl < n), (kf > ql) & (kf >= n))

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.per_batch and self.length.numel() != B:
            raise ValueError(
                f"prefix_lm has {self.length.numel()} lengths {self.length.tolist()} but the "
                f"batch has B={B}; pass an int or one length per sequence"
            )

    def batch_heads(self):
        return (self.length.numel() if self.per_batch else 1), 1

    def __repr__(self) -> str:
        n = self.length.tolist()
        return f"prefix_lm({n if self.per_batch else n[0]})"


def prefix_lm(length) -> Mask:
    """Prefix-LM: the first ``length`` positions are visible to everyone, the rest causally.

    ``length``: an int, or ``(B,)`` ints for a per-sequence prefix. Query ``i`` sees key ``j``
    when ``j < length`` or ``j <= i``.
    """
    return PrefixLM(length)


class BlockSparse(Mask):
    def __init__(self, layout, block_size):
        if not isinstance(layout, torch.Tensor):
            layout = torch.as_tensor(layout)
        if layout.dtype != torch.bool:
            raise TypeError(
                f"block_sparse layout must be a bool tensor (True = the blocks attend), got "
                f"{layout.dtype}; convert 0/1 layouts with .bool()"
            )
        if layout.dim() < 2 or layout.dim() > 4:
            raise ValueError(
                f"block_sparse layout must be (nQ, nK), (H, nQ, nK) or (B, H, nQ, nK), "
                f"got shape {tuple(layout.shape)}"
            )
        while layout.dim() < 4:
            layout = layout.unsqueeze(0)
        self.layout = layout  # (B or 1, H or 1, nQ, nK)
        if isinstance(block_size, int) and not isinstance(block_size, bool):
            bs = (block_size, block_size)
        elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
            bs = tuple(block_size)
        else:
            raise TypeError(
                f"block_sparse block_size must be an int or (block_q, block_k), got {block_size!r}"
            )
        self.block_q = check_positive_int(bs[0], "block_sparse block_size")
        self.block_k = check_positive_int(bs[1], "block_sparse block_size")

    def mask_mod(self, b, h, q_idx, kv_idx):
        lay = self.layout.to(q_idx.device)
        bi = b if lay.shape[0] > 1 else torch.zeros_like(b)
        hi = h if lay.shape[1] > 1 else torch.zeros_like(h)
        qb = torch.div(q_idx, self.block_q, rounding_mode="floor")
        kb = torch.div(kv_idx, self.block_k, rounding_mode="floor")
        return lay[bi, hi, qb, kb]

    def _check_cover(self, q_first: int, q_last: int, k_first: int, k_last: int, what: str):
        nq, nk = self.layout.shape[2], self.layout.shape[3]
        if q_first < 0 or k_first < 0 or q_last >= nq * self.block_q or k_last >= nk * self.block_k:
            raise ValueError(
                f"block_sparse layout of {nq}x{nk} blocks of {self.block_q}x{self.block_k} covers "
                f"query positions 0..{nq * self.block_q - 1} and keys 0..{nk * self.block_k - 1}, "
                f"but the {what} needs query positions {q_first}..{q_last} and keys "
                f"{k_first}..{k_last}; build the layout for the full length"
            )

    def tile_kinds(self, grid, B=1, H=1):
        if grid.n_q == 0 or grid.n_k == 0:
            return torch.zeros(1, 1, grid.n_q, grid.n_k, dtype=torch.int8, device=grid.device)
        self._check_cover(
            grid.q_offset,
            grid.q_offset + grid.Sq - 1,
            grid.kv_offset,
            grid.kv_offset + grid.Sk - 1,
            "tile grid",
        )
        lay = self.layout.to(grid.device).long()
        # 2-D prefix sums so that each tile counts its covered blocks in O(1). A tile covers the
        # rectangle of blocks [q0, q1) × [k0, k1), each of which holds some pair of the tile.
        cs = torch.nn.functional.pad(lay.cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        q0 = torch.div(grid.q_first(), self.block_q, rounding_mode="floor").view(-1)
        q1 = torch.div(grid.q_last(), self.block_q, rounding_mode="floor").view(-1) + 1
        k0 = torch.div(grid.kv_first(), self.block_k, rounding_mode="floor").view(-1)
        k1 = torch.div(grid.kv_last(), self.block_k, rounding_mode="floor").view(-1) + 1

        def at(qi, ki):
            return cs[:, :, qi][:, :, :, ki]

        count = at(q1, k1) - at(q0, k1) - at(q1, k0) + at(q0, k0)  # (B', H', n_q, n_k)
        total = (q1 - q0).view(1, 1, -1, 1) * (k1 - k0).view(1, 1, 1, -1)
        return kinds_from(count == total, count == 0)

    def validate(self, B, H, Sq, Sk, q_offset):
        lb, lh = self.layout.shape[:2]
        if lb not in (1, B) or lh not in (1, H):
            raise ValueError(
                f"block_sparse layout shape {tuple(self.layout.shape)} does not broadcast to "
                f"B={B}, Hq={H}; its leading dims must be 1 or (B, Hq)"
            )
        if Sq and Sk:
            self._check_cover(q_offset, q_offset + Sq - 1, 0, Sk - 1, f"call (q_offset={q_offset})")

    def batch_heads(self):
        return self.layout.shape[0], self.layout.shape[1]

    def __repr__(self) -> str:
        return (
            f"block_sparse(<layout {tuple(self.layout.shape)}>, ({self.block_q}, {self.block_k}))"
        )


def block_sparse(layout, block_size) -> Mask:
    """Block-sparse: query block ``⌊i/bq⌋`` sees key block ``⌊j/bk⌋`` where ``layout`` is True.

    ``layout``: bool ``(nQ, nK)``, ``(H, nQ, nK)`` or ``(B, H, nQ, nK)``; ``block_size``: int or
    ``(bq, bk)``. Blocks are on absolute positions and must cover every position of a call.
    """
    return BlockSparse(layout, block_size)
