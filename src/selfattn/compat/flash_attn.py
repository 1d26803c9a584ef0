"""flash-attn's entry points on selfattn: ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, for code written against ``flash_attn`` (2.x).

Same positional order, keywords and layouts: ``q (B, Sq, H, D)``, ``k/v (B, Sk, Hkv, D)``, packed
``(total, H, D)`` with ``cu_seqlens``, caches ``(B_cache, S_cache, Hkv, D)`` or paged
``(num_blocks, page_size, Hkv, D)``. Same documented semantics:

- ``causal=True`` is aligned to the bottom-right corner when ``Sq != Sk``: query row ``i`` sits
  at position ``i + Sk - Sq``. Rows left with no key (``Sq > Sk``) give output 0::

      Sq=2, Sk=5        Sq=5, Sk=2
      █ █ █ █ ·         · ·
      █ █ █ █ █         · ·
                        · ·
                        █ ·
                        █ █

- ``window_size=(left, right)``: that query attends keys ``[i + Sk - Sq - left,
  i + Sk - Sq + right]``, both ends included; ``-1`` (any negative) leaves a side unbounded;
  ``causal=True`` sets ``right = 0``.
- ``softcap > 0``: ``softcap · tanh(s / softcap)`` on the scaled scores, before the mask;
  ``alibi_slopes (H,)`` or ``(B, H)``: ``-slope · |i + Sk - Sq - j|`` added after it.
- GQA / MQA: ``Hkv`` divides ``H``; query head ``h`` reads kv head ``h // (H // Hkv)``, never
  repeated in memory.

Where this differs from flash-attn (it runs on selfattn's backends, chosen by ``auto``):

- Any dtype selfattn runs (fp16, bf16, fp32, fp64) on any device it runs on, CPU included.
- ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: flash-attn fills ``S_dmask``
  only when ``dropout_p > 0``, as a test hook encoding its own dropout pattern; use
  :func:`selfattn.attention_weights` for the probabilities. ``softmax_lse`` is float32 (float64
  for float64 inputs), ``(B, H, Sq)`` or ``(H, total_q)`` for varlen, and ``-inf`` for a row with
  no key (flash-attn 2 writes ``+inf`` there).
- ``dropout_p`` drops with selfattn's counter-based pattern (the same on every backend), not
  flash-attn's Philox stream: the same distribution, other pairs. ``deterministic`` is accepted
  and has nothing to switch (``num_splits`` likewise).
- ``flash_attn_with_kvcache`` declines ``rotary_cos``/``rotary_sin`` and ``cache_leftpad``
  (rotate q and k with :class:`selfattn.positions.RoPE` first), and needs each sequence to hold
  at least ``Sq`` keys (``cache_seqlens + seqlen_new >= Sq``).
- Outputs are contiguous ``(B, Sq, H, Dv)``; inputs may be any strided views (no copies made
  here).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from selfattn.functional import attention, paged_attention
from selfattn.masks import Mask, causal, sliding_window
from selfattn.masks.tiles import KEY_UNBOUNDED, kinds_from, tile_min_max
from selfattn.scores import ScoreMod
from selfattn.scores import softcap as _softcap

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


# -- masks and score mods with flash-attn's meaning --------------------------------------------


@dataclass(frozen=True)
class _Packing:
    """Packed sequences ``cu_seqlens_q / cu_seqlens_k``, per packed row and column (int64).

    ``q_seq[r]``: the sequence of query row ``r``; ``q_pos[r]``: its position on the packed key
    axis, ``cu_k[s] + (Sk_s - Sq_s) + (r - cu_q[s])`` (bottom-right within its sequence), so that
    ``q_pos[r] - c`` is flash-attn's ``i + Sk_s - Sq_s - j`` for key column ``c = cu_k[s] + j``;
    ``k_seq[c]``: the sequence of key column ``c``.
    """

    q_seq: torch.Tensor
    q_pos: torch.Tensor
    k_seq: torch.Tensor

    @staticmethod
    def build(cu_q: torch.Tensor, cu_k: torch.Tensor, Tq: int, Tk: int) -> _Packing:
        cu_q, cu_k = cu_q.long(), cu_k.long()
        n_q, n_k = cu_q.diff(), cu_k.diff()
        seqs = torch.arange(n_q.numel(), device=cu_q.device)
        q_seq = torch.repeat_interleave(seqs, n_q, output_size=Tq)
        k_seq = torch.repeat_interleave(seqs, n_k, output_size=Tk)
        row = torch.arange(Tq, device=cu_q.device) - cu_q[:-1][q_seq]
        q_pos = (cu_k[:-1] + n_k - n_q)[q_seq] + row
        return _Packing(q_seq, q_pos, k_seq)

    def rows(self, q_idx):
        """``(position, sequence)`` of query rows ``q_idx`` (packed calls run at q_offset 0, so
        a query's absolute position is its row)."""
        row = q_idx
        return self.q_pos.to(row.device)[row], self.q_seq.to(row.device)[row]


class _Window(Mask):
    """flash-attn's local window: key ``j`` visible from query position ``i`` iff
    ``i - left <= j <= i + right`` (a negative bound: unbounded on that side). With ``packing``,
    also only within the query's own sequence (query rows in packed order, ``q_offset=0``)."""

    def __init__(self, left: int, right: int, packing: _Packing | None = None):
        if packing is None and left < 0 and right < 0:
            raise ValueError("an unbounded window without packing is no mask: pass mask=None")
        self.left, self.right, self.packing = left, right, packing

    @property
    def relative(self) -> bool:
        return self.packing is None

    @property
    def row_ordered(self) -> bool:
        return self.packing is not None

    @property
    def is_interval(self) -> bool:
        return self.packing is None

    def _position(self, b, q_idx):
        if self.packing is None:
            return q_idx, None
        return self.packing.rows(q_idx)

    def mask_mod(self, b, h, q_idx, kv_idx):
        pos, seq = self._position(b, q_idx)
        ok = torch.ones((), dtype=torch.bool, device=kv_idx.device)
        if seq is not None:
            ok = ok & (seq == self.packing.k_seq.to(kv_idx.device)[kv_idx])
        if self.left >= 0:
            ok = ok & (kv_idx >= pos - self.left)
        if self.right >= 0:
            ok = ok & (kv_idx <= pos + self.right)
        return ok

    def key_interval(self, b, q_idx):
        if self.packing is not None:
            return None
        lo = q_idx - self.left if self.left >= 0 else torch.full_like(q_idx, -KEY_UNBOUNDED)
        hi = q_idx + self.right + 1 if self.right >= 0 else torch.full_like(q_idx, KEY_UNBOUNDED)
        return lo, hi

    def tile_kinds(self, grid, B=1, H=1):
        kf, kl = grid.kv_first(), grid.kv_last()  # (1, 1, 1, n_k)
        full = empty = torch.zeros((), dtype=torch.bool, device=grid.device)
        full = ~full
        if self.packing is None:
            p_lo, p_hi = grid.q_first(), grid.q_last()  # (1, 1, n_q, 1)
        else:
            # per tile: the range of query positions and of the sequences on each axis
            pk = self.packing
            r0, c0 = grid.q_offset, grid.kv_offset  # packed: q_offset 0, rows = positions
            qpos = pk.q_pos.to(grid.device)[r0 : r0 + grid.Sq].unsqueeze(0)
            qseq = pk.q_seq.to(grid.device)[r0 : r0 + grid.Sq].unsqueeze(0)
            kseq = pk.k_seq.to(grid.device)[c0 : c0 + grid.Sk].unsqueeze(0)
            p_lo, p_hi = (t.view(1, 1, -1, 1) for t in tile_min_max(qpos, grid.n_q, grid.block_q))
            s_lo, s_hi = (t.view(1, 1, -1, 1) for t in tile_min_max(qseq, grid.n_q, grid.block_q))
            t_lo, t_hi = (t.view(1, 1, 1, -1) for t in tile_min_max(kseq, grid.n_k, grid.block_k))
            full = (s_lo == s_hi) & (t_lo == t_hi) & (s_lo == t_lo)
            empty = (s_hi < t_lo) | (t_hi < s_lo)
        if self.left >= 0:  # every key of the tile at or after the lowest bound of every row
            full = full & (kf >= p_hi - self.left)
            empty = empty | (kl < p_lo - self.left)
        if self.right >= 0:
            full = full & (kl <= p_lo + self.right)
            empty = empty | (kf > p_hi + self.right)
        return kinds_from(full, empty)

    def validate(self, B, H, Sq, Sk, q_offset):
        pk = self.packing
        if pk is not None and (Sq, Sk, q_offset) != (pk.q_seq.numel(), pk.k_seq.numel(), 0):
            raise ValueError(
                f"this packed window covers {pk.q_seq.numel()} query rows and "
                f"{pk.k_seq.numel()} keys at q_offset=0, not Sq={Sq}, Sk={Sk}, q_offset={q_offset}"
            )

    def __repr__(self) -> str:
        packed = "" if self.packing is None else ", packed"
        return f"flash_attn_window({self.left}, {self.right}{packed})"


class _Alibi(ScoreMod):
    """flash-attn's ALiBi: ``-slope · |i - j|`` between query position ``i`` and key ``j``, with
    ``slopes (H,)`` or ``(B, H)`` (per sequence when packed)."""

    additive = True

    def __init__(self, slopes: torch.Tensor, packing: _Packing | None = None):
        self.slopes, self.packing = slopes, packing
        self.relative = packing is None and slopes.dim() == 1
        self.row_ordered = packing is not None

    def to(self, device) -> ScoreMod:
        if self.slopes.device == torch.device(device):
            return self
        return self._on_device(device, lambda: _Alibi(self.slopes.to(device), self.packing))

    def _bias(self, b, h, q_idx, kv_idx, dtype):
        if self.packing is None:
            pos, seq = q_idx, b
        else:
            pos, seq = self.packing.rows(q_idx)
        slopes = self.slopes.to(device=h.device, dtype=dtype)
        slope = slopes[h] if slopes.dim() == 1 else slopes[seq, h]
        return -slope * (pos - kv_idx).abs().to(dtype)

    def bias(self, b, h, q_idx, kv_idx):
        return self._bias(b, h, q_idx, kv_idx, torch.float32)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        # fp64 scores (the oracle) get the bias in fp64; every other score adds a float32 bias
        dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
        return score + self._bias(b, h, q_idx, kv_idx, dtype).to(score.dtype)

    def kernel_terms(self, q_offset, Sq, Sk):
        # slopes (H,) or (B, H) on unpacked rows: the kernels' own ALiBi term (cpu_fused takes
        # both, triton (H,)); packed rows' positions restart per sequence: no kernel form
        return (("alibi", self.slopes),) if self.packing is None else None

    def __repr__(self) -> str:
        return f"flash_attn_alibi(<slopes {tuple(self.slopes.shape)}>)"


def _window(window_size, causal_: bool) -> tuple[int, int]:
    """``(left, right)`` with ``-1`` for an unbounded side; ``causal`` sets ``right = 0``."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)
    if not ok:
        raise TypeError(
            f"window_size must be a pair of ints (left, right), -1 for unbounded, got "
            f"{window_size!r}"
        )
    if not isinstance(causal_, bool):
        raise TypeError(f"causal must be True or False, got {causal_!r}")
    left, right = (max(int(x), -1) for x in window_size)
    return left, (0 if causal_ else right)


def _mask(left: int, right: int, packing: _Packing | None = None) -> Mask | None:
    """The window as a selfattn mask: the built-ins where they say it (their fast paths)."""
    if packing is None:
        if left < 0 and right < 0:
            return None
        if right == 0:
            return causal() if left < 0 else sliding_window(left + 1)
    return _Window(left, right, packing)


def _score_mod(softcap, alibi_slopes, H: int, n_seqs: int, packing: _Packing | None = None):
    """softcap then ALiBi, flash-attn's order; None when neither is asked for."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (0.0: off), got {softcap!r}")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be >= 0 and finite (0.0: off), got {softcap!r}")
    mods = [_softcap(softcap)] if softcap > 0 else []
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
            raise TypeError(
                f"alibi_slopes must be a float tensor of shape (H,) or (B, H), got "
                f"{type(alibi_slopes).__name__} {getattr(alibi_slopes, 'dtype', '')}"
            )
        if tuple(alibi_slopes.shape) not in ((H,), (n_seqs, H)):
            raise ValueError(
                f"alibi_slopes of shape {tuple(alibi_slopes.shape)} fit neither (H,) = ({H},) "
                f"nor (B, H) = ({n_seqs}, {H}); pass one slope per query head, or per sequence "
                "and head"
            )
        mods.append(_Alibi(alibi_slopes, packing))
    if not mods:
        return None
    return mods[0] if len(mods) == 1 else mods[0] >> mods[1]


# -- argument checks in flash-attn's words -----------------------------------------------------


def _check_qkv(q, k, v, layout: str, dims: int) -> None:
    """Types, ranks and the shape relations of flash-attn's layouts (named in its terms)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(
                f"{name} must be {dims}-D {layout} (flash-attn's layout), got shape "
                f"{tuple(t.shape)}"
            )
    H, D, Hkv = q.shape[-2], q.shape[-1], k.shape[-2]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on all but the head dim"
        )
    if k.shape[-1] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share the head dim")
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"the number of query heads H={H} (q {tuple(q.shape)}) must be a multiple of the "
            f"number of kv heads Hkv={Hkv} (k {tuple(k.shape)})"
        )


def _check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _int_vector(t, name: str, n: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32), got {t!r}"[:200])
    if t.dim() != 1 or (n is not None and t.numel() != n):
        want = f"({n},)" if n is not None else "1-D"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t


def _check_cu_seqlens(cu, name: str, total: int, max_seqlen, max_name: str) -> None:
    vals = cu.tolist()
    if not vals or vals[0] != 0 or any(b < a for a, b in itertools.pairwise(vals)):
        raise ValueError(
            f"{name} must start at 0 and never decrease (cumulative lengths), got {vals[:8]}"
        )
    if vals[-1] != total:
        raise ValueError(
            f"{name} ends at {vals[-1]} but the packed tensor holds {total} tokens; "
            f"{name}[-1] must be the total"
        )
    longest = max((b - a for a, b in itertools.pairwise(vals)), default=0)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest:
        raise ValueError(
            f"{max_name}={max_seqlen!r} is below the longest sequence ({longest}) in {name}; "
            "pass the maximum length (flash-attn would leave rows past it uncomputed)"
        )


# -- the entry points ----------------------------------------------------------------------------


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``(B, S, H, D) -> (B, H, S, D)``, a view."""
    return t.transpose(1, 2)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_func``: ``q (B, Sq, H, D)``, ``k (B, Sk, Hkv, D)``,
    ``v (B, Sk, Hkv, Dv)`` -> ``out (B, Sq, H, Dv)``, or ``(out, softmax_lse (B, H, Sq), None)``
    with ``return_attn_probs``. Semantics and differences: the module docstring."""
    _check_qkv(q, k, v, "(B, S, H, D)", 4)
    _check_flag(deterministic, "deterministic")
    _check_flag(return_attn_probs, "return_attn_probs")
    B, _, H, _ = q.shape
    left, right = _window(window_size, causal)
    result = attention(
        _heads_first(q),
        _heads_first(k),
        _heads_first(v),
        mask=_mask(left, right),
        score_mod=_score_mod(softcap, alibi_slopes, H, B),
        scale=softmax_scale,
        dropout_p=dropout_p,
        return_lse=return_attn_probs,
    )
    out, lse = result if return_attn_probs else (result, None)
    out = out.transpose(1, 2).contiguous()  # (B, H, Sq, Dv) -> (B, Sq, H, Dv)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's ``flash_attn_varlen_func``: packed sequences without padding.

    ``q (total_q, H, D)``, ``k (total_k, Hkv, D)``, ``v (total_k, Hkv, Dv)``; sequence ``s``
    holds query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1`` and key rows
    ``cu_seqlens_k[s] .. cu_seqlens_k[s+1]-1`` (int32 ``(n_seqs + 1,)``, from 0), each attending
    only within its sequence, bottom-right aligned there. Returns ``out (total_q, H, Dv)``, or
    ``(out, softmax_lse (H, total_q), None)``. One selfattn call over the packed tensors (views,
    no padding): a mask and score mod that look up each row's sequence.
    """
    _check_qkv(q, k, v, "(total, H, D)", 3)
    _check_flag(deterministic, "deterministic")
    _check_flag(return_attn_probs, "return_attn_probs")
    if block_table is not None:
        raise NotImplementedError(
            "flash_attn_varlen_func with block_table (a paged KV cache) is not supported; use "
            "flash_attn_with_kvcache, or selfattn.cache.paged_attention"
        )
    Tq, H, _ = q.shape
    Tk = k.shape[0]
    cu_q, cu_k = (
        _int_vector(cu_seqlens_q, "cu_seqlens_q"),
        _int_vector(cu_seqlens_k, "cu_seqlens_k"),
    )
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_k has {cu_k.numel()}; both "
            "hold n_seqs + 1 cumulative lengths"
        )
    _check_cu_seqlens(cu_q, "cu_seqlens_q", Tq, max_seqlen_q, "max_seqlen_q")
    _check_cu_seqlens(cu_k, "cu_seqlens_k", Tk, max_seqlen_k, "max_seqlen_k")
    packing = _Packing.build(cu_q.to(q.device), cu_k.to(q.device), Tq, Tk)
    left, right = _window(window_size, causal)
    result = attention(
        q.transpose(0, 1).unsqueeze(0),  # (total_q, H, D) -> (1, H, total_q, D)
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask=_Window(left, right, packing),
        score_mod=_score_mod(softcap, alibi_slopes, H, cu_q.numel() - 1, packing),
        scale=softmax_scale,
        dropout_p=dropout_p,
        q_offset=0,  # rows are packed: the mask and score mod place them
        return_lse=return_attn_probs,
    )
    out, lse = result if return_attn_probs else (result, None)
    out = out[0].transpose(0, 1).contiguous()  # (1, H, total_q, Dv) -> (total_q, H, Dv)
    return (out, lse[0], None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flash-attn's ``flash_attn_with_kvcache``: decode (or a chunk of new tokens) over a cache,
    appending the new K/V in place first.

    ``q (B, Sq, H, D)``. The cache: ``k_cache/v_cache (B_cache, S_cache, Hkv, D)`` (row
    ``cache_batch_idx[b]``, default ``b``, holds sequence ``b``), or paged ``(num_blocks,
    page_size, Hkv, D)`` with ``block_table (B, max_blocks)`` int32 listing each sequence's pages
    in order. ``cache_seqlens`` (int or ``(B,)`` int32): tokens already cached (default: the
    whole cache). ``k, v (B, S_new, Hkv, D)``: written into the cache at positions
    ``cache_seqlens[b] .. cache_seqlens[b] + S_new - 1``, in place; the caller advances
    ``cache_seqlens``. Query row ``i`` then sits at position ``cache_seqlens[b] + S_new - Sq + i``
    (bottom-right). Runs :func:`selfattn.paged_attention` on the cache as it is (a contiguous
    cache is a pool of ``B_cache`` pages of ``S_cache`` tokens): the C decode kernel on CPU, the
    Triton kernel on CUDA, for the masks they take. Returns ``out (B, Sq, H, Dv)``, or
    ``(out, softmax_lse (B, H, Sq))`` with ``return_softmax_lse``.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError(
            "flash_attn_with_kvcache's fused rotary embedding (rotary_cos / rotary_sin) is not "
            "supported: rotate q and the new k first (e.g. selfattn.positions.RoPE), then call "
            "without rotary_cos / rotary_sin"
        )
    if cache_leftpad is not None:
        raise NotImplementedError(
            "cache_leftpad is not supported: keep each sequence's cache starting at position 0, "
            "or mask its left padding with selfattn.cache.paged_attention(mask=...)"
        )
    _check_qkv(q, k_cache, v_cache, "(B, S, H, D) / (num_blocks, page_size, H, D)", 4)
    _check_flag(return_softmax_lse, "return_softmax_lse")
    B, Sq, H, _ = q.shape
    dev = q.device
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (paged cache)")
        table = block_table
        if not isinstance(table, torch.Tensor) or table.is_floating_point() or table.dim() != 2:
            raise ValueError(
                f"block_table must be an int32 (B, max_blocks) tensor, got {table!r}"[:200]
            )
        capacity = table.shape[1] * k_cache.shape[1]
        table = table.to(device=dev, dtype=torch.int32)  # what the paged kernels read
    else:
        rows = torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx
        rows = _int_vector(rows, "cache_batch_idx", B)
        table = rows.view(B, 1).to(device=dev, dtype=torch.int32)  # each sequence: one "page"
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k / v needs cache_seqlens (where to write them)")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=dev)
    cached = _int_vector(cache_seqlens, "cache_seqlens", B).to(dev)
    new = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append, or neither")
    if k is not None:
        _check_qkv(q, k, v, "(B, S_new, Hkv, D)", 4)
        if k.shape[0] != B or k.shape[2:] != k_cache.shape[2:] or v.shape[2:] != v_cache.shape[2:]:
            raise ValueError(
                f"new k {tuple(k.shape)} / v {tuple(v.shape)} must be (B={B}, S_new, Hkv, D) "
                f"matching the cache's {tuple(k_cache.shape[2:])} / {tuple(v_cache.shape[2:])}"
            )
        if (k.dtype, v.dtype) != (k_cache.dtype, v_cache.dtype):
            raise TypeError(
                f"new k / v are {k.dtype} / {v.dtype} but the cache holds {k_cache.dtype} / "
                f"{v_cache.dtype}; cast them to the cache's dtype"
            )
        new = k.shape[1]
    seq_lens = cached.long() + new
    bad = ((seq_lens > capacity) | (cached < 0)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(
            f"cache_seqlens[{b}]={int(cached[b])} + {new} new tokens exceeds the cache capacity "
            f"{capacity} ({'max_blocks × page_size' if paged else 'S_cache'}) or is negative"
        )
    short = (seq_lens < Sq).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(
            f"sequence {b} holds {int(seq_lens[b])} keys (cache_seqlens + new) but q has Sq={Sq} "
            "rows; selfattn needs at least Sq keys per sequence (the queries are its last tokens)"
        )
    if new:
        _append(k_cache, v_cache, k, v, table, cached, paged)
    left, right = _window(window_size, causal)
    result = paged_attention(
        _heads_first(q),
        k_cache,
        v_cache,
        table,
        seq_lens.to(torch.int32),
        mask=_mask(left, right),
        score_mod=_score_mod(softcap, alibi_slopes, H, B),
        scale=softmax_scale,
        return_lse=return_softmax_lse,
    )
    out, lse = result if return_softmax_lse else (result, None)
    out = out.transpose(1, 2).contiguous()  # (B, H, Sq, Dv) -> (B, Sq, H, Dv)
    return (out, lse) if return_softmax_lse else out


def _append(k_cache, v_cache, k, v, table, cached, paged: bool) -> None:
    """Write ``k, v (B, S_new, Hkv, ·)`` at positions ``cached[b] + t`` of each sequence, in
    place: one indexed store per tensor."""
    B, S_new = k.shape[:2]
    pos = cached.long().view(B, 1) + torch.arange(S_new, device=cached.device)  # (B, S_new)
    P = k_cache.shape[1]
    page = table.long().gather(1, pos // P) if paged else table.long().expand(B, S_new)
    slot = pos % P if paged else pos
    k_cache[page, slot] = k
    v_cache[page, slot] = v
