"""``PageStore``: the K/V pages of every layer of a paged cache, and their writes and reads.

Memory layout: keys and values live in fixed-size pages, ``k_pages (N, P, Hkv, D)`` and
``v_pages (N, P, Hkv, Dv)`` per layer, stored for all ``L`` layers at once as ``k_store (L, N,
P, Hkv, D)`` and ``v_store (L, N, P, Hkv, Dv)``. Where ``Dv == D`` both are views of one pool,
``kv_store (L, N, 2, P, Hkv, D)``: a page's keys and then its values, adjacent in memory
(FlashInfer's ``(num_pages, 2, page_size, num_kv_heads, head_dim)`` layout per layer), so that
a decode reads one run per page where two pools make it two places far apart. ``kv_store`` is
None where ``Dv != D`` (two pools). Page ``p`` of layer ``i`` holds the layer-``i`` K/V of the
same tokens as page ``p`` of every other layer: one page id names a page of every layer.

Quantised pages (``dtype=torch.int8`` or ``torch.float8_e4m3fn``, :mod:`selfattn.cache.quant`):
each token's K/V is quantised when written and read back through ``paged_attention``'s scales.
int8 keeps one bfloat16 scale per (layer, page slot, kv head), ``k_scales (L, N, P, Hkv)``,
copied with its page; fp8 one float32 per (layer, kv head), ``k_scales (L, Hkv)``, fixed by the
first write into the layer (its absolute maximum × :data:`FP8_HEADROOM` / 448; larger values
saturate).

Writes go to a step's planned slots (:class:`~selfattn.cache.paged.plan.StepPlan`); the store
knows nothing of sequences, only of page ids.
"""

from __future__ import annotations

import torch

from selfattn.backends.paged.call import QUANT_DTYPES
from selfattn.cache import memory
from selfattn.cache.paged.plan import StepPlan
from selfattn.cache.quant import FP8_MAX, INT8_SCALE_DTYPE, dequantize, quantize_fp8, quantize_int8

__all__ = ["FP8_HEADROOM", "PageStore", "check_attend", "check_new_kv"]

# fp8 pages: the per-head scale leaves room for values this many times the first write's
# largest before they saturate (e4m3 keeps 3 mantissa bits at any exponent, so the headroom
# costs no precision above 448 / FP8_HEADROOM / 2**6 of the scale's range).
FP8_HEADROOM = 8.0


class PageStore:
    """The pages of ``n_layers`` layers (module docstring): ``k_store`` / ``v_store`` (and
    ``kv_store`` where ``Dv == D``), ``k_layers[i]`` / ``v_layers[i]`` layer ``i``'s ``(N, P,
    Hkv, ·)`` views, ``k_scales`` / ``v_scales`` for quantised pages (else None); on huge pages
    where the OS has them (:mod:`selfattn.cache.memory`)."""

    def __init__(
        self, n_layers: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
        value_dim: int, *, dtype, device,
    ):  # fmt: skip
        fk = {"dtype": dtype, "device": device}
        shape = (n_layers, num_pages, page_size, n_kv_heads)
        self.kv_store: torch.Tensor | None = None
        if value_dim == head_dim:
            self.kv_store = memory.zeros(n_layers, num_pages, 2, *shape[2:], head_dim, **fk)
            self.k_store, self.v_store = self.kv_store[:, :, 0], self.kv_store[:, :, 1]
        else:
            self.k_store = memory.zeros(*shape, head_dim, **fk)
            self.v_store = memory.zeros(*shape, value_dim, **fk)
        self.k_scales = self.v_scales = None
        if dtype in QUANT_DTYPES:
            int8 = dtype == torch.int8
            per = shape if int8 else (n_layers, n_kv_heads)
            sk = {"dtype": INT8_SCALE_DTYPE if int8 else torch.float32, "device": device}
            self.k_scales, self.v_scales = torch.ones(*per, **sk), torch.ones(*per, **sk)
        self._scaled = [False] * n_layers  # fp8: the layer's scales are set (first write)
        # L × (N, P, Hkv, ·) views (one select each: unbind's views refuse in-place writes
        # under autograd)
        self.k_layers = [self.k_store[i] for i in range(n_layers)]
        self.v_layers = [self.v_store[i] for i in range(n_layers)]
        # L × the layer's (K, V) pages as rows, for writes without autograd (write_rows)
        self._rows = [self.layer_rows(i) for i in range(n_layers)]

    def share_values(self, v_store: torch.Tensor) -> None:
        """Make ``v_store (L, N, P, Hkv, Dv)`` the values: a view of the keys, for latent
        caches whose values are the keys' first columns (their writes store the keys only,
        never through :meth:`write_rows`)."""
        self.v_store = v_store
        self.v_layers = [v_store[i] for i in range(v_store.shape[0])]

    @property
    def page_size(self) -> int:
        return self.k_store.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V pages of every layer, with their quantisation scales."""
        scales = (self.k_scales, self.v_scales) if self.k_scales is not None else ()
        return sum(t.nbytes for t in (self.k_store, self.v_store, *scales))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scales, v_scales)`` of ``layer`` for ``paged_attention`` (None for float pages)."""
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V pages as rows to write at a plan's slots: ``(N·P, Hkv,
        ·)`` views of the two pools (indexed by ``plan.slots``), or with a ``kv_store`` its
        ``(N·2·P, Hkv, D)`` view twice (indexed by ``plan.pair_slots``)."""
        if self.kv_store is not None:
            rows = self.kv_store[layer].view(-1, *self.kv_store.shape[-2:])
            return rows, rows
        k, v = self.k_store[layer], self.v_store[layer]
        return k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:])

    # -- writes ---------------------------------------------------------------------------------
    def copy_page(self, old: int, new: int) -> None:
        """Page ``old``'s K/V (and int8 scales) into page ``new``, in every layer at once."""
        if self.kv_store is not None:
            self.kv_store[:, new].copy_(self.kv_store[:, old])
        else:
            self.k_store[:, new].copy_(self.k_store[:, old])
            self.v_store[:, new].copy_(self.v_store[:, old])
        if self.k_scales is not None and self.k_scales.dim() == 4:  # int8: per slot
            self.k_scales[:, new].copy_(self.k_scales[:, old])
            self.v_scales[:, new].copy_(self.v_scales[:, old])

    def write_rows(self, layer: int, plan: StepPlan, k_rows: torch.Tensor, v_rows) -> None:
        """Store ``k_rows (B·S, Hkv, D)``, ``v_rows (B·S, Hkv, Dv)`` at ``plan``'s slots of
        layer ``layer``: row ``b·S + s`` is token ``s`` of sequence ``b``."""
        Hkv = k_rows.shape[1]
        # The layer's pages as rows (layer_rows), a view made now under autograd: one made
        # before a write would be refused there as a stale leaf.
        kr, vr = self.layer_rows(layer) if torch.is_grad_enabled() else self._rows[layer]
        if self.kv_store is not None:
            ki, vi = plan.pair_slots
        else:
            ki = vi = plan.slots
        if self.k_scales is None:
            # the dtype tests skip no-op ``to`` calls: a write runs once per layer of each step
            kr.index_copy_(0, ki, k_rows if k_rows.dtype == kr.dtype else k_rows.to(kr.dtype))
            vr.index_copy_(0, vi, v_rows if v_rows.dtype == vr.dtype else v_rows.to(vr.dtype))
            return
        if kr.dtype != torch.int8 and not self._scaled[layer]:
            for rows, scales in ((k_rows, self.k_scales), (v_rows, self.v_scales)):
                amax = rows.detach().abs().float().amax(dim=(0, 2)) * (FP8_HEADROOM / FP8_MAX)
                scales[layer] = torch.where(amax > 0, amax, torch.ones_like(amax))  # (Hkv,)
            self._scaled[layer] = True
        for rows, flat, at, scales in (
            (k_rows, kr, ki, self.k_scales[layer]),
            (v_rows, vr, vi, self.v_scales[layer]),
        ):
            if flat.dtype == torch.int8:
                q, s = quantize_int8(rows)  # (T, Hkv, ·) int8, (T, Hkv) bfloat16
                flat.index_copy_(0, at, q)
                scales.view(-1, Hkv).index_copy_(0, plan.slots, s)
            else:  # fp8: the layer's per-head scales; index_copy_ moves the bytes
                q, _ = quantize_fp8(rows, scales)
                flat.view(torch.uint8).index_copy_(0, at, q.view(torch.uint8))

    def move_rows(self, src, dst) -> None:
        """Copy, in every layer ``l`` and KV head ``h``, the token at ``(page, slot) =
        (src[0][l, h, i], src[1][l, h, i])`` to ``(dst[0][i], dst[1][i])`` for each ``i`` (int64
        tensors ``(L, Hkv, n)`` and ``(n,)``), keys, values and int8 scales alike. Every source
        is read before any destination is written, so the two may overlap (compaction)."""
        pages, slots = src
        heads = torch.arange(pages.shape[1], device=pages.device)
        scaled = self.k_scales is not None and self.k_scales.dim() == 4  # int8: per slot
        for layer in range(pages.shape[0]):
            where = (pages[layer].T, slots[layer].T, heads)  # (n, Hkv) each, heads broadcast
            held = [(t, t[where]) for t in self._token_tensors(layer, scaled)]
            for t, rows in held:
                t[dst] = rows

    def clear_rows(self, layers, pages, slots, heads) -> None:
        """Zero the key and value of ``(page, slot)`` ``(pages[i], slots[i])``, KV head
        ``heads[i]`` in layer ``layers[i]`` (int64 tensors ``(n,)``): a ragged compaction's
        holes (``0`` in every page dtype; int8 scales stay, scaling a zero)."""
        for layer in layers.unique().tolist():
            at = layers == layer
            where = (
                pages[at.to(pages.device)],
                slots[at.to(slots.device)],
                heads[at.to(heads.device)],
            )
            for t in self._token_tensors(layer, False):
                t[where] = 0

    def _token_tensors(self, layer: int, scaled: bool) -> list[torch.Tensor]:
        """Layer ``layer``'s ``(N, P, Hkv, ...)`` tensors that hold something per token: its
        key and value pages (fp8 as bytes, which indexing moves) and int8 scales."""
        found = [self.k_layers[layer]]
        if self.v_layers[layer].data_ptr() != self.k_layers[layer].data_ptr():
            found.append(self.v_layers[layer])  # a latent pool's values are its keys
        found = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in found]
        if scaled:
            found += [self.k_scales[layer], self.v_scales[layer]]
        return found

    # -- reads ----------------------------------------------------------------------------------
    def gather_pages(self, ids: torch.Tensor, n: int, layer: int = 0):
        """Contiguous copies ``(Hkv, n, D)``, ``(Hkv, n, Dv)`` of the first ``n`` tokens held
        by pages ``ids`` (int64, in order) in ``layer``; quantised pages come back in float32."""
        k = self.k_layers[layer].index_select(0, ids).flatten(0, 1)[:n]  # (pages·P, Hkv, D)
        v = self.v_layers[layer].index_select(0, ids).flatten(0, 1)[:n]
        if self.k_scales is not None:
            ks, vs = self.layer_scales(layer)
            if ks.dim() == 3:  # int8: the slots' scales, gathered like the pages
                ks = ks.index_select(0, ids).flatten(0, 1)[:n]
                vs = vs.index_select(0, ids).flatten(0, 1)[:n]
            k, v = dequantize(k, ks), dequantize(v, vs)
        return k.transpose(0, 1), v.transpose(0, 1)  # (n, Hkv, ·) -> (Hkv, n, ·)


def check_new_kv(store: PageStore, B: int, k, v) -> int:
    """``S`` of new ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` for ``store``'s pages;
    TypeError / ValueError naming the offending shapes otherwise."""
    Hkv, D = store.k_store.shape[3:]
    Dv = store.v_store.shape[4]
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"k and v must be tensors, got {type(k).__name__}, {type(v).__name__}")
    if k.dim() != 4 or tuple(k.shape[:2]) != (B, Hkv) or k.shape[3] != D:
        raise ValueError(
            f"k must be (B={B}, Hkv={Hkv}, S, D={D}) for {B} sequence(s), got {tuple(k.shape)}"
        )
    S = k.shape[2]
    if tuple(v.shape) != (B, Hkv, S, Dv):
        raise ValueError(f"v must be (B={B}, Hkv={Hkv}, S={S}, Dv={Dv}), got {tuple(v.shape)}")
    return S


def check_attend(kv, seq_ids: list[int], q, k, v) -> None:
    """TypeError / ValueError naming the offending shapes unless ``q (B, Hq, Sq, D)`` and a
    step's ``k``, ``v`` fit ``kv`` (a :class:`~selfattn.cache.PagedKV`) and the batch
    ``seq_ids``."""
    B = len(seq_ids)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be (B={B}, Hq, Sq, D) for seq_ids {seq_ids}, got {got}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[2] != q.shape[2]:
        got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
        raise ValueError(f"k must hold one new token per query: q {tuple(q.shape)}, k {got}")
    check_new_kv(kv.store, B, k, v)
    if q.dtype != kv.k_store.dtype and kv.k_scales is None:
        raise TypeError(
            f"q is {q.dtype} but the cache stores {kv.k_store.dtype}; build the "
            f"{type(kv).__name__} with the model's dtype"
        )
