"""``LatentAttention``: multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434 §2.1).

Keys and values of every head are decompressed from one low-rank latent per token, and the
positions travel in a separate, shared rope key ("decoupled RoPE")::

    x (B, S, d) --kv_a_proj--> [c | k_rope]      c (B, S, r) RMS-normed, k_rope (B, S, dr)
    c --kv_b_proj (W_UK | W_UV per head)--> k_nope (B, H, S, dn), v (B, H, S, dv)
    q = q_proj(x)  (or q_b(norm(q_a(x))) with q_lora_rank)  -> [q_nope (dn) | q_rope (dr)] per head
    score(i, j) = scale · (q_nope_i · k_nope_j + rope(q_rope_i) · rope(k_rope_j))

Two orders compute the same scores (tested equal in float64):

* naive (prefill, training): decompress ``k = [k_nope | k_rope]`` ``(B, H, Sk, dn + dr)`` and ``v
  (B, H, Sk, dv)`` for every head, then MHA with ``D = dn + dr``, ``Dv = dv``;
* absorbed (decode): since ``q_nope · (W_UK c) = (W_UKᵀ q_nope) · c``, project each query into the
  latent space once and attend over the latent rows themselves, one key/value head for all query
  heads (MQA): ``q = [W_UKᵀ q_nope | rope(q_rope)]`` ``(B, H, Sq, r + dr)``, ``k = [c | rope(
  k_rope)]`` ``(B, 1, Sk, r + dr)``, ``v = c`` ``(B, 1, Sk, r)``; the output ``(B, H, Sq, r)``
  goes back through ``W_UV`` per head. The scale stays the original head's (``1/sqrt(dn + dr)``
  by default), not ``1/sqrt(r + dr)``: the scores are the same numbers.

The cache holds only ``[c | rope(k_rope)]`` per token (:mod:`selfattn.cache.latent`):
``(r + dr)`` numbers instead of ``H · (dn + dr + dv)``. Per step the naive order costs about
``Sk·r·H·(dn + dv)`` (decompression) + ``Sq·Sk·H·(dn + dr + dv)`` multiply-adds, the absorbed
one ``Sq·r·H·(dn + dv)`` + ``Sq·Sk·H·(2r + dr)``: ``order="auto"`` takes the cheaper
(:meth:`LatentAttention.absorbed_is_cheaper`), which is the absorbed one for decode and the
naive one for a prefill with ``dn + dv < 2r`` (every DeepSeek config). A cache that attends in
place (the paged latent pages) always runs the absorbed order: its pages hold latents.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validate import one_of, positive_int
from selfattn.cache.base import KV, attends_in_place
from selfattn.cache.latent import latent_value
from selfattn.functional import attention
from selfattn.nn.attention import positions_after
from selfattn.nn.norms import RMSNorm

__all__ = ["LatentAttention"]

ORDERS = ("auto", "naive", "absorbed")


class LatentAttention(nn.Module):
    """Multi-head latent attention over ``(B, S, d_model)``; see the module docstring.

    Args:
        d_model: model width; ``n_heads``: query heads ``H``.
        kv_lora_rank: the latent width ``r`` (what the cache stores, with the rope key).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: ``dn``, ``dr``, ``dv`` per head.
        q_lora_rank: None (one ``q_proj``) or the rank of the low-rank query path
            (``q_a_proj``, ``q_a_norm``, ``q_b_proj``).
        rope: ``rope(x (B, H, S, dr), positions) -> x`` for the rope parts (e.g. a
            :class:`~selfattn.positions.RoPE` of ``dr`` dims).
        scale: score scale, default ``1/sqrt(dn + dr)`` (DeepSeek multiplies in YaRN's mscale²).
        order: ``"auto"``, ``"naive"`` or ``"absorbed"`` (module docstring).
        bias: bias on ``q_a_proj`` / ``kv_a_proj`` and ``out_proj`` (DeepSeek's
            ``attention_bias``); ``norm_eps``: the latent RMSNorms' eps.

    Parameters: ``q_proj`` (or ``q_a_proj``, ``q_a_norm``, ``q_b_proj``), ``kv_a_proj (d -> r +
    dr)``, ``kv_a_norm (r)``, ``kv_b_proj (r -> H·(dn + dv))``: per head ``dn`` rows of ``W_UK``
    then ``dv`` rows of ``W_UV``, and ``out_proj (H·dv -> d)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope=None,
        scale: float | None = None,
        order: str = "auto",
        bias: bool = False,
        norm_eps: float = 1e-6,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (
            ("d_model", d_model), ("n_heads", n_heads), ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
            ("v_head_dim", v_head_dim),
        ):  # fmt: skip
            positive_int(value, f"LatentAttention {name}")
        if q_lora_rank is not None:
            positive_int(q_lora_rank, "LatentAttention q_lora_rank")
        if rope is not None and not callable(rope):
            raise TypeError(f"rope must be callable as rope(x, positions), got {type(rope)}")
        self.d_model, self.n_heads = d_model, n_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.order = one_of(order, "LatentAttention order", ORDERS)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if scale is None else scale
        self.rope, self.backend = rope, backend
        fk = {"device": device, "dtype": dtype}
        q_out = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_out, bias=False, **fk)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias, **fk)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps, **fk)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False, **fk)
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=bias, **fk)
        self.kv_a_norm = RMSNorm(kv_lora_rank, norm_eps, **fk)
        kv_out = n_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = nn.Linear(kv_lora_rank, kv_out, bias=False, **fk)
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=bias, **fk)

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.rope_dim

    # -- the two halves of kv_b_proj --------------------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK (H, dn, r)`` and ``W_UV (H, dv, r)``: views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, -1)
        return w.split([self.nope_dim, self.v_dim], dim=1)  # (H, dn + dv, r) -> 2 × (H, ·, r)

    def absorbed_is_cheaper(self, Sq: int, Sk: int) -> bool:
        """Whether the absorbed order costs fewer multiply-adds for ``Sq`` queries over ``Sk``
        keys (module docstring; per head, the common ``Sq·Sk·dr`` terms cancel)."""
        r, dn, dv = self.kv_lora_rank, self.nope_dim, self.v_dim
        naive = Sk * r * (dn + dv) + Sq * Sk * (dn + dv)
        absorbed = Sq * r * (dn + dv) + Sq * Sk * 2 * r
        return absorbed < naive

    # -- projections -----------------------------------------------------------------------------
    def latents(self, x: torch.Tensor, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (B, H, S, dn + dr)`` (rope part rotated) and the cache rows ``[c | rope(k_rope)]``
        ``(B, 1, S, r + dr)`` of ``x (B, S, d_model)`` at ``positions``."""
        B, S, _ = x.shape
        q = (
            self.q_proj(x)
            if self.q_lora_rank is None
            else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        )
        q = q.view(B, S, self.n_heads, -1).transpose(1, 2)  # (B, S, H·(dn+dr)) -> (B, H, S, dn+dr)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c)
        k_rope = k_rope[:, None]  # (B, S, dr) -> (B, 1, S, dr): one head shared by all
        if self.rope is not None:
            q_rope, k_rope = self.rope(q_rope, positions), self.rope(k_rope, positions)
        rows = torch.cat([c[:, None], k_rope], dim=-1)  # (B, 1, S, r + dr)
        return torch.cat([q_nope, q_rope], dim=-1), rows

    def _naive(self, q, rows, **kw) -> torch.Tensor:
        """MHA over decompressed keys/values: ``(B, H, Sq, dv)``."""
        B, _, Sk, _ = rows.shape
        c, k_rope = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c[:, 0])  # (B, Sk, r) -> (B, Sk, H·(dn+dv))
        kv = kv.view(B, Sk, self.n_heads, -1).transpose(1, 2)  # -> (B, H, Sk, dn + dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat(
            [k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1
        )  # (B, H, Sk, dn+dr)
        return attention(q, k, v, scale=self.scale, backend=self.backend, **kw)

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q (B, H, Sq, dn + dr)`` -> ``[W_UKᵀ q_nope | q_rope]`` ``(B, H, Sq, r + dr)``."""
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk)  # (B, H, Sq, dn) -> (B, H, Sq, r)
        return torch.cat([q_lat, q_rope], dim=-1)

    def absorb_output(self, out: torch.Tensor) -> torch.Tensor:
        """Latent outputs ``(B, H, Sq, r)`` -> per-head values ``(B, H, Sq, dv)`` (``W_UV``)."""
        _, w_uv = self._w_uk_uv()
        return torch.einsum("bhsr,hvr->bhsv", out, w_uv)

    def _absorbed(self, q, rows, **kw) -> torch.Tensor:
        """MQA over the latent rows, one shared head: ``(B, H, Sq, dv)``."""
        out = attention(
            self.absorb_query(q), rows, latent_value(rows, self.kv_lora_rank), scale=self.scale,
            backend=self.backend, **kw,
        )  # fmt: skip
        return self.absorb_output(out)

    def forward(self, x: torch.Tensor, *, mask=None, score_mod=None, positions=None, cache=None,
                q_offset: int | None = None) -> torch.Tensor:  # fmt: skip
        """Self-attend ``x (B, Sq, d_model)`` -> ``(B, Sq, d_model)``.

        ``mask``, ``score_mod``, ``positions``, ``q_offset`` as in
        :class:`~selfattn.nn.MultiHeadAttention`. ``cache``: a latent cache
        (:class:`~selfattn.cache.latent.LatentCache`, or a layer of a
        :class:`~selfattn.cache.latent.PagedLatentKV` step, which attends in place: absorbed).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be (B, Sq, d_model={self.d_model}), got shape {tuple(x.shape)}"
            )
        B, Sq, _ = x.shape
        if positions is None:
            positions = positions_after(cache, B, Sq, x.device)
        q, rows = self.latents(x, positions)
        if attends_in_place(cache):  # paged latent pages: the absorbed order in place
            if q_offset is not None:
                raise ValueError(
                    f"q_offset={q_offset} cannot be combined with a cache that attends itself "
                    f"({type(cache).__name__}); drop q_offset"
                )
            out = cache.attend(
                self.absorb_query(q), rows, latent_value(rows, self.kv_lora_rank), mask=mask,
                score_mod=score_mod, scale=self.scale,
            )  # fmt: skip
            out = self.absorb_output(out)
        else:
            if cache is not None:
                kv = cache.update(rows, latent_value(rows, self.kv_lora_rank))
                rows = kv[0]  # (B, 1, Sq, r + dr) -> (B, 1, Sk, r + dr)
                if isinstance(kv, KV):
                    mask, score_mod, q_offset = kv.at_key_positions(mask, score_mod, q_offset, q)
            order = self.order
            if order == "auto":
                absorbed = self.absorbed_is_cheaper(Sq, rows.shape[2])
                order = "absorbed" if absorbed else "naive"
            run = self._absorbed if order == "absorbed" else self._naive
            out = run(q, rows, mask=mask, score_mod=score_mod, q_offset=q_offset)
        out = out.transpose(1, 2).reshape(B, Sq, -1)  # (B, H, Sq, dv) -> (B, Sq, H·dv)
        return self.out_proj(out)
