"""Recurrent sequence mixers, drop-in for attention in a pre-norm block: ``x (B, S, d_model) ->
(B, S, d_model)``, with an optional :class:`~selfattn.cache.state.LayerState` for decoding.

==================  =======================================  ==================================
layer               state per head                           scan (:mod:`.scan`)
==================  =======================================  ==================================
LinearAttention     ``(Dk, Dv + 1)``: sums of φ(k)vᵀ, φ(k)   plain, no decay; φ = elu + 1
Mamba2Mixer         ``(N, P)`` + conv window                 plain, decay exp(A·dt) per head
GatedDeltaNet       ``(Dk, Dv)`` + conv window               delta rule, decay, beta = σ(b)
==================  =======================================  ==================================

A step of one token with a cache runs :func:`~.scan.scan_step`; longer inputs (prefill,
training) run :func:`~.scan.chunked_scan`, from the cached state if any. ``rows (B, S)`` (1 =
token, 0 = padding) zeroes padded tokens before they reach the state, so a left-padded row
computes what the unpadded one does (as transformers' ``apply_mask_to_padding_states``).

Mamba2Mixer keeps transformers' parameter names and layout (``Mamba2Mixer`` / ``BambaMixer``),
so checkpoints load unchanged; GatedDeltaNet follows Qwen3-Next's semantics (l2-normed q and k,
``g = -exp(A_log)·softplus(a + dt_bias)``, a per-head gated RMSNorm after the scan) with its
projections in plain ``[q | k | v | z]`` and ``[b | a]`` blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validate import positive_int, positive_number
from selfattn.alternatives.scan import chunked_scan, scan_step
from selfattn.cache.state import LayerState, state_bytes

__all__ = [
    "GatedDeltaNet",
    "GatedRMSNorm",
    "LinearAttention",
    "Mamba2Mixer",
    "RecurrentMixer",
    "causal_conv",
]

# Mamba-2's dt initialisation range (Dao & Gu 2024, as mamba_ssm and transformers)
_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4
_L2_EPS = 1e-6  # flash-linear-attention's l2norm epsilon, which Qwen3-Next uses


def _dt_bias(n_heads: int) -> torch.Tensor:
    """Mamba's step-size init: ``softplus(dt_bias)`` log-spaced over [_DT_MIN, _DT_MAX] across
    the heads, the same for every model."""
    dt = torch.exp(torch.linspace(math.log(_DT_MIN), math.log(_DT_MAX), n_heads))
    dt = dt.clamp(min=_DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution over time: ``x (B, S, C)``, ``weight (C, K)``, ``history (B,
    C, K-1)`` the inputs before ``x`` (None: zeros) -> ``(y (B, S, C), new history (B, C, K-1))``.
    Token ``t`` sees inputs ``t-K+1 .. t``; the history makes a step continue a prefill exactly."""
    B, _, Cc = x.shape
    K = weight.shape[-1]
    xt = x.transpose(1, 2).to(weight.dtype)  # (B, S, C) -> (B, C, S)
    if history is None:
        history = xt.new_zeros(B, Cc, K - 1)
    full = torch.cat([history.to(xt.dtype), xt], dim=-1)  # (B, C, K-1+S)
    y = F.conv1d(full, weight[:, None], bias, groups=Cc)  # (B, C, S)
    return y.transpose(1, 2).to(x.dtype), full[..., full.shape[-1] - (K - 1) :]


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate, over groups of ``group_size`` channels, in float32.

    ``norm_before_gate=False`` (Mamba-2): ``weight · rms_norm(x · silu(z))``; ``True``
    (Qwen3-Next): ``weight · rms_norm(x) · silu(z)``.
    """

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-6, *,
                 norm_before_gate: bool = False):  # fmt: skip
        super().__init__()
        positive_int(dim, "GatedRMSNorm dim")
        group_size = dim if group_size is None else group_size
        if dim % group_size:
            raise ValueError(f"GatedRMSNorm dim ({dim}) must be divisible by group_size "
                             f"({group_size})")  # fmt: skip
        positive_number(eps, "GatedRMSNorm eps")
        self.group_size, self.eps, self.norm_before_gate = group_size, float(eps), norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        h = x.to(acc)
        if not self.norm_before_gate:
            h = h * F.silu(gate.to(acc))
        g = h.unflatten(-1, (-1, self.group_size))  # (..., dim) -> (..., G, group_size)
        h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if not self.norm_before_gate:
            return self.weight * h.to(dtype)
        return (self.weight * h.to(dtype) * F.silu(gate.to(acc))).to(dtype)


def _zero_padding(x: torch.Tensor, rows) -> torch.Tensor:
    return x if rows is None else x * rows[..., None].to(x.dtype)


def _scan(layer, q, k, v, g, beta, cache, conv):
    """Run the scan of ``layer`` (step or chunks) from ``cache``'s state and store the result."""
    S = q.shape[2]
    if cache is not None and S == 1:  # decode: one token, no chunks
        beta1 = None if beta is None else beta[:, :, 0]
        g1 = None if g is None else g[:, :, 0]
        out, state = scan_step(cache.state, q[:, :, 0], k[:, :, 0], v[:, :, 0], g1, beta1)
        out = out[:, :, None].to(q.dtype)
    else:
        init = None if cache is None else cache.state
        out, state = chunked_scan(q, k, v, g, beta, chunk_size=layer.chunk_size, initial_state=init)
    if cache is not None:
        cache.write(conv, state, S)
    return out  # (B, H, S, Dv)


class RecurrentMixer(nn.Module):
    """What the three layers share: a state of ``state_shape = (H, Dk, Dv)`` per sequence after
    a causal conv over ``conv_dim`` channels of width ``conv_width`` (none: 0 and 1), made by
    :meth:`make_state`, checked on every call."""

    conv_dim, conv_width = 0, 1

    @property
    def state_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def make_state(self, batch: int, *, dtype=torch.float32, device=None) -> LayerState:
        """A zero state for ``batch`` sequences (pass it as ``cache=``)."""
        return LayerState(batch, self.conv_dim, self.conv_width, self.state_shape, dtype=dtype,
                          device=device)  # fmt: skip

    def state_bytes(self, dtype=torch.float32) -> int:
        """Bytes of one sequence's state (:func:`~selfattn.cache.state.state_bytes`)."""
        return state_bytes(self.conv_dim, self.conv_width, self.state_shape, dtype)

    def forward(self, x, *, cache: LayerState | None = None, rows=None) -> torch.Tensor:
        """``x (B, S, d_model)`` -> ``(B, S, d_model)``; ``cache`` a :class:`LayerState` from
        :meth:`make_state` (updated in place), ``rows (B, S)`` 1 = token, 0 = padding."""
        if cache is not None:
            if not isinstance(cache, LayerState):
                raise TypeError(
                    f"{type(self).__name__} takes a LayerState cache (selfattn.cache.state), got "
                    f"{type(cache).__name__}; build it with make_cache or layer.make_state"
                )
            if cache.batch != x.shape[0]:
                raise ValueError(
                    f"the cache holds {cache.batch} rows but the input has {x.shape[0]}"
                )
        return self._mix(x, cache, rows)

    def _mix(self, x, cache, rows) -> torch.Tensor:
        raise NotImplementedError


class LinearAttention(RecurrentMixer):
    """Causal linear attention (Katharopoulos et al., 2020): ``o_t = Σ_{s<=t} φ(q_t)·φ(k_s) v_s
    / Σ_{s<=t} φ(q_t)·φ(k_s)`` with ``φ = elu + 1``; the normaliser rides in the state as a
    column of ones appended to ``v`` (state ``(H, Dk, Dv + 1)`` per sequence)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *,
                 chunk_size: int = 64, bias: bool = False):  # fmt: skip
        super().__init__()
        positive_int(n_heads, "LinearAttention n_heads")
        self.n_heads = n_heads
        self.head_dim = head_dim or d_model // n_heads
        positive_int(self.head_dim, "LinearAttention head_dim")
        self.chunk_size = positive_int(chunk_size, "LinearAttention chunk_size")
        self.qkv_proj = nn.Linear(d_model, 3 * n_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.n_heads, self.head_dim, self.head_dim + 1)

    def _mix(self, x, cache, rows) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv_proj(x).view(B, S, 3, self.n_heads, self.head_dim).unbind(2)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        q, k, v = F.elu(q.to(acc)) + 1, F.elu(k.to(acc)) + 1, v.to(acc)
        k = _zero_padding(k.flatten(2), rows).view_as(k)  # a padded token writes nothing
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, S, H, D) -> (.., D + 1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D)
        out = _scan(self, q, k, v, None, None, cache, None)  # (B, H, S, D + 1)
        # the normaliser φ(q)·Σφ(k) > 0 once a row has seen a token; a fully padded prefix: 0/0
        den = out[..., -1:].clamp(min=torch.finfo(out.dtype).tiny)
        out = (out[..., :-1] / den).transpose(1, 2).reshape(B, S, -1)
        return self.out_proj(out.to(x.dtype))


class Mamba2Mixer(RecurrentMixer):
    """Mamba-2's mixer (Dao & Gu, 2024), transformers' ``Mamba2Mixer`` torch path.

    ``in_proj`` gives ``z`` (the gate), ``xBC`` (through the causal conv and SiLU) and ``dt`` per
    head; the SSD scan runs with ``q = C``, ``k = B``, ``v = x·dt``, ``g = A·dt`` (``A =
    -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` clamped to ``dt_limit``), then ``+ D·x``,
    the gated RMSNorm (gate before norm, ``n_groups`` groups) and ``out_proj``. ``B`` and ``C``
    have ``n_groups`` heads, each serving ``n_heads / n_groups`` heads (as GQA).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        state_size: int = 128,
        n_groups: int = 1,
        conv_width: int = 4,
        chunk_size: int = 256,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        conv_bias: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        for name, value in (("n_heads", n_heads), ("head_dim", head_dim), ("n_groups", n_groups),
                            ("state_size", state_size), ("conv_width", conv_width)):  # fmt: skip
            positive_int(value, f"Mamba2Mixer {name}")
        if n_heads % n_groups:
            raise ValueError(
                f"Mamba2Mixer n_heads ({n_heads}) must be divisible by n_groups ({n_groups})"
            )
        self.n_heads, self.head_dim, self.n_groups = n_heads, head_dim, n_groups
        self.state_size, self.conv_width = state_size, conv_width
        self.chunk_size = positive_int(chunk_size, "Mamba2Mixer chunk_size")
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.d_inner = n_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * state_size
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + n_heads, bias=bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim,
                                padding=conv_width - 1, bias=conv_bias)  # fmt: skip
        # S4D-real A = -(1..H); dt from log-uniform [_DT_MIN, _DT_MAX] (inverse softplus)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.dt_bias = nn.Parameter(_dt_bias(n_heads))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // n_groups, norm_eps)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.n_heads, self.state_size, self.head_dim)

    def _mix(self, x, cache, rows) -> torch.Tensor:
        B, S, _ = x.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.state_size
        z, xbc, dt = self.in_proj(_zero_padding(x, rows)).split(
            [self.d_inner, self.conv_dim, H], dim=-1
        )
        hist = None if cache is None else cache.conv
        xbc, hist = causal_conv(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, hist)
        xbc = _zero_padding(F.silu(xbc), rows)
        xs, b, c = xbc.split([self.d_inner, G * N, G * N], dim=-1)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).to(acc).clamp(*self.dt_limit)  # (B, S, H)
        a = -torch.exp(self.A_log.to(acc))
        xs = xs.view(B, S, H, P).to(acc)

        def heads(t):  # (B, S, G·N) -> (B, H, S, N): group g serves heads g·H/G ..
            return t.view(B, S, G, N).repeat_interleave(H // G, dim=2).transpose(1, 2)

        v = (xs * dt[..., None]).transpose(1, 2)  # (B, H, S, P)
        y = _scan(self, heads(c), heads(b), v, (dt * a).transpose(1, 2), None, cache, hist)
        y = y.transpose(1, 2) + xs * self.D.to(acc)[:, None]  # (B, S, H, P)
        y = self.norm(y.reshape(B, S, self.d_inner), z)
        return self.out_proj(y.to(x.dtype))


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2025), Qwen3-Next's linear-attention layer.

    ``n_heads`` value heads of ``v_head_dim``; ``n_k_heads`` query/key heads of ``head_dim``
    (default ``n_heads``; each serves ``n_heads / n_k_heads`` value heads). q, k, v go through a
    causal conv (no bias) and SiLU; q and k are l2-normed, q scaled by ``head_dim^-1/2``;
    ``beta = sigmoid(b)``, ``g = -exp(A_log)·softplus(a + dt_bias)``; after the delta-rule scan a
    per-head gated RMSNorm (norm, then ``· silu(z)``) and ``out_proj``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        n_k_heads: int | None = None,
        v_head_dim: int | None = None,
        conv_width: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        n_k_heads = n_heads if n_k_heads is None else n_k_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in (("n_heads", n_heads), ("head_dim", head_dim), ("n_k_heads", n_k_heads),
                            ("v_head_dim", v_head_dim), ("conv_width", conv_width)):  # fmt: skip
            positive_int(value, f"GatedDeltaNet {name}")
        if n_heads % n_k_heads:
            raise ValueError(
                f"GatedDeltaNet n_heads ({n_heads}) must be divisible by n_k_heads ({n_k_heads})"
            )
        self.n_heads, self.n_k_heads, self.head_dim, self.v_head_dim = (
            n_heads, n_k_heads, head_dim, v_head_dim,
        )  # fmt: skip
        self.conv_width = conv_width
        self.chunk_size = positive_int(chunk_size, "GatedDeltaNet chunk_size")
        self.key_dim, self.value_dim = n_k_heads * head_dim, n_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = nn.Linear(d_model, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * n_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim,
                                padding=conv_width - 1, bias=False)  # fmt: skip
        # A in [1, 16] (Qwen3-Next draws it from U(0.01, 16)); dt_bias as Mamba-2's, as
        # flash-linear-attention trains it. Not Qwen3-Next's dt_bias = 1 (a placeholder for
        # loaded weights): softplus(1) · A kept 0.27 of the state per token at most, so a
        # freshly built layer forgot everything within a few tokens and could not learn recall.
        self.dt_bias = nn.Parameter(_dt_bias(n_heads))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, n_heads)))
        self.norm = GatedRMSNorm(v_head_dim, eps=norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.n_heads, self.head_dim, self.v_head_dim)

    def _mix(self, x, cache, rows) -> torch.Tensor:
        B, S, _ = x.shape
        H, Dk, Dv = self.n_heads, self.head_dim, self.v_head_dim
        x = _zero_padding(x, rows)
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)  # (B, S, H) each
        hist = None if cache is None else cache.conv
        qkv, hist = causal_conv(qkv, self.conv1d.weight[:, 0], None, hist)
        q, k, v = F.silu(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rep = H // self.n_k_heads

        def heads(t, d, rep=rep):  # (B, S, h·d) -> (B, H, S, d): a k head serves `rep` v heads
            return t.to(acc).view(B, S, -1, d).repeat_interleave(rep, dim=2).transpose(1, 2)

        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + _L2_EPS) for t in
                (heads(q, Dk), heads(k, Dk)))  # fmt: skip
        q = q * Dk**-0.5
        beta = torch.sigmoid(b.to(acc)).transpose(1, 2)  # (B, H, S)
        g = -torch.exp(self.A_log.to(acc)) * F.softplus(a.to(acc) + self.dt_bias.to(acc))
        out = _scan(self, q, k, heads(v, Dv, 1), g.transpose(1, 2), beta, cache, hist)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z.view(B, S, H, Dv))  # (B, S, H, Dv)
        return self.out_proj(out.reshape(B, S, self.value_dim))
