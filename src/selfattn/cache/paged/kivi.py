"""KIVI pages: a paged pool whose full pages hold 2-bit or 4-bit KIVI codes (``kivi2``, ``kivi4``).

A page of ``P`` tokens is one KIVI key group (:mod:`selfattn.cache.kivi`): keys per channel,
one ``(scale, zero)`` per (layer, page, kv head, channel); values per token, one per (layer,
page, kv head, slot, group of ``g = min(P, Dv)`` channels); codes packed into uint8. The rule
is :class:`~selfattn.cache.kivi.KIVICache`'s with ``group=P, residual=0``: a sequence's tokens
past its last full page (the page still filling, its recent window) stay in full precision, and
a page is quantised when its last slot is written, since the key group needs the whole page.

Memory layout, ``L`` layers, ``N`` pages, ``F`` fill buffers, ``per = 8 // bits``::

    k_codes (L, N, Hkv, P, D // per) uint8      k_scale, k_zero (L, N, Hkv, D)   dtype
    v_codes (L, N, Hkv, P, Dv // per) uint8     v_scale, v_zero (L, N, Hkv, P, Dv // g)
    k_fill (L, F, P, Hkv, D), v_fill (L, F, P, Hkv, Dv) dtype: the pages still filling

``fill_of[page]`` names the fill buffer holding a page that is not full, or -1 (the page's
codes hold it). ``F = 2 * max_seqs``: a sequence has at most one page filling, and a page
that fills in a step keeps its buffer until the next step's first write (the step's later
layers read it); buffers of freed pages are taken back when none is free.

Attention reads (:meth:`KIVIPagedKV.attention_pages`) dequantise the pages a step's block
table names into a compact float pool (the fill buffers as they are) with the table renumbered
into it, once per layer: every paged backend then reads float pages. A shared page is never
written (copy-on-write copies codes, scales and fill buffer); a page trimmed back to a partial
one (a speculative rollback) is dequantised into a fill buffer at its next write, its kept
tokens then carrying their quantisation error into the page's next quantisation.
"""

from __future__ import annotations

import torch

from selfattn.cache.kivi import (
    Quantized,
    check_kivi,
    dequantize_keys,
    dequantize_values,
    kivi_bytes,
    quantize_keys,
    quantize_values,
    value_group,
)
from selfattn.cache.paged.kv import PagedKV
from selfattn.cache.paged.plan import StepPlan

__all__ = ["KIVI_PAGE_DTYPES", "KIVIPageStore", "KIVIPagedKV", "kivi_page_bytes"]

# the pool dtypes of KIVI pages and their bits
KIVI_PAGE_DTYPES = {"kivi2": 2, "kivi4": 4}


def kivi_bits(name) -> int:
    """Bits of a KIVI page dtype name (ValueError naming the choices otherwise)."""
    if not isinstance(name, str) or name not in KIVI_PAGE_DTYPES:
        raise ValueError(f"KIVI page dtype must be one of {sorted(KIVI_PAGE_DTYPES)}, got {name!r}")
    return KIVI_PAGE_DTYPES[name]


def kivi_page_bytes(n_layers, n_kv_heads, head_dim, page_size, kind, dtype, value_dim=None):
    """Bytes of one full KIVI page of every layer: codes and scales (:func:`kivi_bytes` of
    ``page_size`` tokens with ``group=page_size, residual=0``)."""
    return kivi_bytes(n_layers, n_kv_heads, head_dim, page_size, kivi_bits(kind), page_size, 0,
                      dtype, value_dim=value_dim)  # fmt: skip


class KIVIPageStore:
    """The KIVI pages of ``n_layers`` layers (module docstring), with the
    :class:`~selfattn.cache.paged.PageStore` interface a :class:`KIVIPagedKV` uses.
    ``k_store`` / ``v_store`` are ``(L, N, P, Hkv, ·)`` views of one zero (the pool's geometry
    and dtype, no memory): the pages are read through :meth:`dequantized`."""

    kv_store = k_scales = v_scales = None

    def __init__(self, n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim, *,
                 bits, fills, dtype, device):  # fmt: skip
        self.bits = bits
        check_kivi(bits, page_size)
        P, per, H = page_size, 8 // bits, n_kv_heads
        for what, n in (("head_dim", head_dim), ("value_dim", value_dim)):
            if n % per:
                raise ValueError(
                    f"KIVI pages of {bits} bits pack {per} channels a byte: {what} ({n}) must "
                    f"be a multiple of {per}; use kivi4 or a float kv_dtype"
                )
        self.value_group = value_group(P, value_dim)
        u8, fk = {"dtype": torch.uint8, "device": device}, {"dtype": dtype, "device": device}
        L, N = n_layers, num_pages
        self.k_codes = torch.zeros(L, N, H, P, head_dim // per, **u8)
        self.k_scale = torch.zeros(L, N, H, head_dim, **fk)
        self.k_zero = torch.zeros_like(self.k_scale)
        self.v_codes = torch.zeros(L, N, H, P, value_dim // per, **u8)
        self.v_scale = torch.zeros(L, N, H, P, value_dim // self.value_group, **fk)
        self.v_zero = torch.zeros_like(self.v_scale)
        self.k_fill = torch.zeros(L, fills, P, H, head_dim, **fk)
        self.v_fill = torch.zeros(L, fills, P, H, value_dim, **fk)
        zero = torch.zeros((), **fk)
        self.k_store = zero.expand(L, N, P, H, head_dim)
        self.v_store = zero.expand(L, N, P, H, value_dim)
        self.k_layers = [self.k_store[i] for i in range(L)]
        self.v_layers = [self.v_store[i] for i in range(L)]
        self.fill_of = [-1] * N  # page -> its fill buffer, or -1 (its codes hold it)
        self.fill_at = torch.full((N,), -1, dtype=torch.long, device=device)  # the same
        self.free_fills = list(range(fills - 1, -1, -1))
        self.is_free = lambda page: False  # set by the owner: whether a page is unreferenced
        self._released: list[int] = []  # buffers of pages that filled in the latest step
        self._step: tuple[StepPlan, list] | None = None  # the latest step's page moves

    @property
    def page_size(self) -> int:
        return self.k_store.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, scales and fill buffers of every layer."""
        held = (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                self.v_zero, self.k_fill, self.v_fill)  # fmt: skip
        return sum(t.nbytes for t in held)

    def layer_scales(self, layer: int):
        return None, None

    # -- fill buffers ---------------------------------------------------------------------------
    def _set_fill(self, page: int, fill: int) -> None:
        self.fill_of[page] = fill
        self.fill_at[page] = fill

    def _take_fill(self) -> int:
        if not self.free_fills:  # take back the buffers of freed pages
            for page, fill in enumerate(self.fill_of):
                if fill >= 0 and self.is_free(page):
                    self._set_fill(page, -1)
                    self.free_fills.append(fill)
        if not self.free_fills:
            raise RuntimeError(
                f"KIVI pages: all {self.k_fill.shape[1]} fill buffers hold pages still filling; "
                "build the pool with a larger max_seqs"
            )
        return self.free_fills.pop()

    def copy_page(self, old: int, new: int) -> None:
        """Page ``old`` (codes, scales, fill buffer) into page ``new``, in every layer."""
        for t in (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                  self.v_zero):  # fmt: skip
            t[:, new].copy_(t[:, old])
        src = self.fill_of[old]
        if self.fill_of[new] >= 0:
            self.free_fills.append(self.fill_of[new])
            self._set_fill(new, -1)
        if src >= 0:
            fill = self._take_fill()
            self.k_fill[:, fill].copy_(self.k_fill[:, src])
            self.v_fill[:, fill].copy_(self.v_fill[:, src])
            self._set_fill(new, fill)

    # -- writes ---------------------------------------------------------------------------------
    def _moves(self, plan: StepPlan) -> list:
        """Per page the step writes: ``(page, source, fill, full)``: source the fill buffer
        holding its earlier slots, -1 for none (it starts at slot 0) or -2 for its codes (a
        page trimmed back); fill the buffer it ends in (-1 when it ends full). Worked out at
        the step's first write; the page states change then for every layer."""
        if self._step is not None and self._step[0] is plan:
            return self._step[1]
        self.free_fills += self._released
        self._released = []
        P = self.page_size
        spans: dict[int, list[int]] = {}
        for s in plan.slots.tolist():
            lo_hi = spans.setdefault(s // P, [P, 0])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], s % P), max(lo_hi[1], s % P + 1)
        moves = []
        for page, (lo, hi) in spans.items():
            had = self.fill_of[page]
            source = -1 if lo == 0 else (had if had >= 0 else -2)
            full = hi == P
            if full:
                fill = -1
                if had >= 0:
                    self._released.append(had)  # read by this step's later layers
                    self._set_fill(page, -1)
            else:
                fill = had if had >= 0 else self._take_fill()
                self._set_fill(page, fill)
            moves.append((page, source, fill, full))
        self._step = (plan, moves)
        return moves

    def write_rows(self, layer: int, plan: StepPlan, k_rows: torch.Tensor, v_rows) -> None:
        """Store ``k_rows (T, Hkv, D)``, ``v_rows (T, Hkv, Dv)`` at ``plan``'s slots of layer
        ``layer``: pages that fill are quantised, the others kept in their fill buffers."""
        moves = self._moves(plan)
        dev, P = self.k_fill.device, self.page_size
        pages = torch.tensor([m[0] for m in moves], dtype=torch.long, device=dev)
        source = torch.tensor([m[1] for m in moves], dtype=torch.long, device=dev)
        # (n, P, Hkv, ·): each page's earlier slots (its fill buffer or its codes)
        k_tmp, v_tmp = self.dequantized(layer, pages, source.clamp(min=-1))
        where = torch.full_like(self.fill_at, -1)
        where[pages] = torch.arange(len(moves), device=dev)
        slots = plan.slots.to(dev)
        at = where[slots // P] * P + slots % P  # rows of the temporary pages
        k_tmp.view(-1, *k_tmp.shape[2:]).index_copy_(0, at, k_rows.to(k_tmp.dtype))
        v_tmp.view(-1, *v_tmp.shape[2:]).index_copy_(0, at, v_rows.to(v_tmp.dtype))
        full = [i for i, m in enumerate(moves) if m[3]]
        if full:
            self._quantize(layer, pages[full], k_tmp[full], v_tmp[full])
        part = [i for i, m in enumerate(moves) if not m[3]]
        if part:
            fills = torch.tensor([moves[i][2] for i in part], dtype=torch.long, device=dev)
            self.k_fill[layer].index_copy_(0, fills, k_tmp[part])
            self.v_fill[layer].index_copy_(0, fills, v_tmp[part])

    def _quantize(self, layer, pages, k, v) -> None:
        """Quantise whole pages ``k (n, P, Hkv, D)``, ``v (n, P, Hkv, Dv)`` into ``pages``."""
        qk = quantize_keys(k.transpose(1, 2), self.bits, self.page_size)  # (n, Hkv, P, D)
        qv = quantize_values(v.transpose(1, 2), self.bits, self.value_group)
        self.k_codes[layer].index_copy_(0, pages, qk.codes)
        self.k_scale[layer].index_copy_(0, pages, qk.scale.squeeze(2))
        self.k_zero[layer].index_copy_(0, pages, qk.zero.squeeze(2))
        self.v_codes[layer].index_copy_(0, pages, qv.codes)
        self.v_scale[layer].index_copy_(0, pages, qv.scale)
        self.v_zero[layer].index_copy_(0, pages, qv.zero)

    # -- reads ----------------------------------------------------------------------------------
    def dequantized(self, layer: int, ids: torch.Tensor, fill: torch.Tensor | None = None):
        """Float copies ``(n, P, Hkv, D)``, ``(n, P, Hkv, Dv)`` of pages ``ids`` (int64) of
        ``layer``: full pages dequantised, filling ones as their fill buffers hold them
        (``fill (n,)``: the buffer of each page, -1 for its codes; default ``fill_of``)."""
        dtype = self.k_fill.dtype
        qk = Quantized(self.k_codes[layer, ids], self.k_scale[layer, ids].unsqueeze(2),
                       self.k_zero[layer, ids].unsqueeze(2), self.bits, self.page_size)  # fmt: skip
        qv = Quantized(self.v_codes[layer, ids], self.v_scale[layer, ids],
                       self.v_zero[layer, ids], self.bits, self.value_group)  # fmt: skip
        k = dequantize_keys(qk, dtype).transpose(1, 2).contiguous()  # (n, Hkv, P, ·) -> (n, P, ·)
        v = dequantize_values(qv, dtype).transpose(1, 2).contiguous()
        fill = self.fill_at[ids] if fill is None else fill
        filling = (fill >= 0).nonzero().flatten()
        if filling.numel():
            k[filling] = self.k_fill[layer, fill[filling]]
            v[filling] = self.v_fill[layer, fill[filling]]
        return k, v

    def gather_pages(self, ids: torch.Tensor, n: int, layer: int = 0):
        """Float copies ``(Hkv, n, D)``, ``(Hkv, n, Dv)`` of the first ``n`` tokens held by
        pages ``ids`` (int64, in order) in ``layer``."""
        k, v = self.dequantized(layer, ids)
        return k.flatten(0, 1)[:n].transpose(0, 1), v.flatten(0, 1)[:n].transpose(0, 1)


class KIVIPagedKV(PagedKV):
    """A :class:`PagedKV` of KIVI pages (module docstring): ``KIVIPagedKV(n_layers, num_pages,
    page_size, n_kv_heads, head_dim, value_dim=None, *, bits=2, max_seqs, max_pages_per_seq,
    prefix_caching=False, dtype, device)``; ``dtype`` is the fill buffers', scales' and
    attention's float dtype. Forks, copy-on-write, trim, prefix caching and undo as a plain
    pool; compaction (KV-compression presses) is refused: KIVI is the pool's compression."""

    query_blocks = True

    def __init__(self, n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim=None,
                 *, bits: int = 2, dtype=torch.float32, device=None, **kw):  # fmt: skip
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1):
            raise ValueError(
                f"KIVIPagedKV dtype is the scales' and fill buffers' float dtype (the model's), "
                f"got {dtype!r}"
            )
        self._kivi = {"bits": bits}
        super().__init__(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim,
                         dtype=dtype, device=device, **kw)  # fmt: skip
        self.store.is_free = lambda page: self.blocks.pool.refcount(page) == 0
        self._read: tuple | None = None  # (plan, table, ids, attention plan) of the step

    def _make_store(self, n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim, *,
                    dtype, device, max_seqs):  # fmt: skip
        return KIVIPageStore(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim,
                             bits=self._kivi["bits"], fills=2 * max_seqs, dtype=dtype,
                             device=device)  # fmt: skip

    @property
    def bits(self) -> int:
        return self.store.bits

    def write(self, layer: int, plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        B, Hkv, S, D = k.shape
        k_rows = k.transpose(1, 2).reshape(B * S, Hkv, D)
        v_rows = v.transpose(1, 2).reshape(B * S, Hkv, v.shape[3])
        self.store.write_rows(layer, plan, k_rows, v_rows)

    def attention_pages(self, layer: int, plan: StepPlan):
        """The step's pages dequantised into a compact float pool, with the block table
        renumbered into it (module docstring)."""
        from selfattn.backends.paged.plan import PagedAttentionPlan

        if self._read is None or self._read[0] is not plan:
            table = plan.block_table.long()
            held = table >= 0
            ids = torch.unique(table[held])
            where = torch.full((self.num_pages,), -1, dtype=torch.long, device=table.device)
            where[ids] = torch.arange(ids.numel(), device=table.device)
            compact = torch.where(held, where[table.clamp(min=0)], -1).to(torch.int32)
            Sq = 1 if plan.packed else plan.n_tokens
            attn = PagedAttentionPlan(
                compact, plan.seq_lens, valid_for=(max(1, ids.numel()), self.page_size, Sq)
            )
            self._read = (plan, compact, ids, attn)  # fmt: skip
        _, compact, ids, attn = self._read
        k, v = self.store.dequantized(layer, ids)
        return k, v, compact, attn, None, None

    def __repr__(self) -> str:
        return super().__repr__().replace("(", f"(bits={self.bits}, ", 1)
