"""One linear recurrence, two ways to run it: chunk by chunk (prefill, training) and token by token
(decode). Plain causal linear attention, Mamba-2's SSD and the gated delta rule are all this scan.

Per head, with a state ``S (Dk, Dv)`` (the decay ``exp(g_t) <= 1``, ``g`` the log decay)::

    plain  (beta=None):  S_t = exp(g_t) S_{t-1} + k_t v_tᵀ                      o_t = S_tᵀ q_t
    delta  (beta given): S_t = exp(g_t) S_{t-1} + k_t u_tᵀ,
                         u_t = beta_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t)           o_t = S_tᵀ q_t

Without decay the plain scan is causal linear attention (Katharopoulos et al., 2020); with a
scalar decay per head and token it is Mamba-2's state-space dual (Dao & Gu, 2024: ``q = C``,
``k = B``, ``v = x·dt``, ``g = A·dt``); the delta form is DeltaNet's rule (Yang et al., 2024),
gated as in Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2025; Qwen3-Next).

The chunked form (:func:`chunked_scan`) splits the sequence into chunks of ``C`` tokens: inside a
chunk, an attention-like ``(C, C)`` product with the pairwise decays ``exp(γ_i - γ_j)`` (``γ`` the
running sum of ``g``); across chunks, the state carried once per chunk. The delta rule's
corrections inside a chunk form a unit lower-triangular system ``(I + A) U = beta·V - W S_0``,
solved once for all chunks (the WY / UT transform). Every exponent is ``<= 0`` for ``g <= 0``, so
nothing overflows. Accumulation is float32 (float64 stays float64).
"""

from __future__ import annotations

import torch

__all__ = ["chunked_scan", "recurrent_scan", "scan_step"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q, k, v, log_decay, beta, initial_state) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"scan needs q, k (B, H, S, Dk) and v (B, H, S, Dv) with equal B, H, S; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, S, Dk = q.shape
    for name, t in (("log_decay", log_decay), ("beta", beta)):
        if t is not None and tuple(t.shape) != (B, H, S):
            raise ValueError(f"scan {name} must be (B, H, S) = {(B, H, S)}, got {tuple(t.shape)}")
    if log_decay is not None and bool((log_decay > 0).any()):
        raise ValueError(
            f"scan log_decay must be <= 0 (a decay exp(g) <= 1), got a maximum of "
            f"{float(log_decay.max())}; pass -softplus(...) or A·dt with A < 0"
        )
    want = (B, H, Dk, v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"scan initial_state must be (B, H, Dk, Dv) = {want}, got {tuple(initial_state.shape)}"
        )


def chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over ``q, k (B, H, S, Dk)``, ``v (B, H, S, Dv)`` in chunks of ``chunk_size``.

    ``log_decay (B, H, S)`` (``<= 0``; None: no decay), ``beta (B, H, S)`` (None: the plain rule),
    ``initial_state (B, H, Dk, Dv)`` (None: zeros). Returns ``out (B, H, S, Dv)`` in ``q``'s dtype
    and the final state ``(B, H, Dk, Dv)`` in the accumulation dtype (float32, or float64).
    Differentiable in every input.
    """
    _check(q, k, v, log_decay, beta, initial_state)
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, H, S, Dk = q.shape
    Dv, out_dtype, acc = v.shape[-1], q.dtype, _acc_dtype(q.dtype)
    C = min(chunk_size, S)
    pad = -S % C
    n = (S + pad) // C

    def chunks(t, last=True):  # (B, H, S[, D]) -> (B, H, n, C[, D]); zero padding: no update
        t = t.to(acc)
        t = torch.nn.functional.pad(t, (0, 0, 0, pad) if last else (0, pad))
        return t.reshape(B, H, n, C, -1) if last else t.reshape(B, H, n, C)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g = chunks(log_decay, last=False) if log_decay is not None else q.new_zeros(B, H, n, C)
    gam = g.cumsum(-1)  # (B, H, n, C): log of the decay from the chunk start to token i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(γ_i - γ_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    pair = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scores = (q @ k.transpose(-1, -2)) * pair  # (B, H, n, C, C)
    if beta is None:
        u_base, w = v, None
    else:
        b = chunks(beta, last=False)[..., None]  # (B, H, n, C, 1)
        kb = k * b
        # (I + A) U = beta·V - (beta·exp(γ)·K) S_0, A strictly lower: beta_i exp(γ_i-γ_j) k_i·k_j
        system = ((kb @ k.transpose(-1, -2)) * pair).tril(-1)
        system = system + torch.eye(C, dtype=acc, device=q.device)
        solve = torch.linalg.solve_triangular
        u_base = solve(system, v * b, upper=False, unitriangular=True)
        w = solve(system, kb * gam.exp()[..., None], upper=False, unitriangular=True)
    q_read = q * gam.exp()[..., None]  # reads the chunk's start state
    k_write = k * (gam[..., -1:] - gam).exp()[..., None]  # writes into the chunk's end state
    decay = gam[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1): the whole chunk's decay
    state = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(acc)
    outs = []
    for c in range(n):  # the only sequential part: one state hand-over per chunk
        u = u_base[:, :, c] if w is None else u_base[:, :, c] - w[:, :, c] @ state
        outs.append(q_read[:, :, c] @ state + scores[:, :, c] @ u)  # (B, H, C, Dv)
        state = state * decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :S]  # (B, H, n·C, Dv) -> (B, H, S, Dv)
    return out.to(out_dtype), state


def scan_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``state (B, H, Dk, Dv)``, ``q, k (B, H, Dk)``, ``v (B, H, Dv)``, ``log_decay,
    beta (B, H)`` -> ``(out (B, H, Dv), new state)``, both in the state's dtype."""
    acc = state.dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    if log_decay is not None:
        state = state * log_decay.to(acc).exp()[..., None, None]
    u = v
    if beta is not None:  # the delta rule: write only what the state does not already predict
        u = beta.to(acc)[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def recurrent_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token (:func:`scan_step` ``S`` times): the oracle of :func:`chunked_scan`
    and the decode path. Same arguments and results."""
    _check(q, k, v, log_decay, beta, initial_state)
    B, H, S, Dk = q.shape
    acc = _acc_dtype(q.dtype)
    state = (
        q.new_zeros(B, H, Dk, v.shape[-1], dtype=acc)
        if initial_state is None
        else initial_state.to(acc)
    )
    outs = []
    for t in range(S):
        g = None if log_decay is None else log_decay[:, :, t]
        b = None if beta is None else beta[:, :, t]
        o, state = scan_step(state, q[:, :, t], k[:, :, t], v[:, :, t], g, b)
        outs.append(o)
    return torch.stack(outs, dim=2).to(q.dtype), state
