"""``SlidingWindowCache``: a ring buffer holding the last ``window`` tokens of each layer."""

from __future__ import annotations

import torch

from selfattn.cache.base import KV
from selfattn.cache.static import check_new_kv, dense_storage

__all__ = ["SlidingWindowCache"]


class SlidingWindowCache:
    """KV cache for ``masks.sliding_window(window)``: memory stays ``window`` tokens at any length.

    Memory layout: a ring ``k (B, Hkv, window, D)``, ``v (B, Hkv, window, Dv)``; the token at
    absolute position ``p`` lives in slot ``p % window`` until position ``p + window`` overwrites
    it. ``length`` counts every token ever appended (absolute, not capped at ``window``), so the
    layer's RoPE positions and ``cache.length`` stay exact after wrap-around.

    :meth:`update` with ``S`` new tokens returns, in position order (oldest first), the last
    ``min(length, window - 1)`` cached tokens followed by the ``S`` new ones: exactly the keys
    that ``sliding_window(window)`` lets any of the ``S`` queries see (query ``p`` sees
    ``p - window + 1 .. p``). The queries are the last ``S`` returned rows, so the default
    bottom-right ``q_offset`` lines them up with their own keys. ``key_start`` (also the returned
    ``KV.start``) is the absolute position of the first returned key: the layer evaluates masks
    and score mods at ``key_start + j`` (:meth:`~selfattn.cache.base.KV.at_key_positions`), so
    the window mask & key padding give the full-sequence result. Other masks (plain causal)
    would see a truncated history: this cache is for windowed attention only.
    """

    def __init__(
        self,
        batch: int,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        dtype=torch.float32,
        device=None,
    ):
        self.k, self.v = dense_storage(
            type(self).__name__, batch, ("window", window), n_kv_heads, head_dim, value_dim,
            dtype, device,
        )  # fmt: skip
        self.length = 0
        self.key_start = 0

    @property
    def window(self) -> int:
        return self.k.shape[2]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every token (the ring is kept and overwritten by later updates)."""
        self.length = 0
        self.key_start = 0

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None) -> KV:
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` at absolute positions ``length ..``.

        ``positions`` (optional, ``(S,)`` ints) must be those next ``S`` positions: a ring buffer
        only appends. Returns ``KV(k_all, v_all, start=key_start)`` of shapes
        ``(B, Hkv, n + S, D)`` and ``(B, Hkv, n + S, Dv)`` with ``n = min(length, window - 1)``
        old tokens first, key ``j`` at absolute position ``key_start + j``; new tensors, not
        views of the ring (their order differs from the ring's after wrap-around).
        """
        S = check_new_kv(self.k, self.v, k, v)
        W = self.window
        device = self.k.device
        new_pos = torch.arange(self.length, self.length + S, device=device)
        if positions is not None:
            positions = torch.as_tensor(positions, device=device)
            if positions.shape != (S,) or not torch.equal(positions.long(), new_pos):
                raise ValueError(
                    f"SlidingWindowCache appends only: positions must be "
                    f"{self.length}..{self.length + S - 1} (length={self.length}, S={S}), got "
                    f"{positions.tolist()}; reset() the cache to start a new sequence"
                )
        n_old = min(self.length, W - 1)
        old_slots = torch.arange(self.length - n_old, self.length, device=device) % W
        # (B, Hkv, W, D) -> (B, Hkv, n_old, D) in position order, then the S new tokens
        k_all = torch.cat([self.k.index_select(2, old_slots), k.to(self.k.dtype)], dim=2)
        v_all = torch.cat([self.v.index_select(2, old_slots), v.to(self.v.dtype)], dim=2)
        keep = min(S, W)  # of the new tokens only the last `window` survive in the ring
        self.k.index_copy_(2, new_pos[S - keep :] % W, k_all[:, :, n_old + S - keep :])
        self.v.index_copy_(2, new_pos[S - keep :] % W, v_all[:, :, n_old + S - keep :])
        self.key_start = self.length - n_old
        self.length += S
        return KV(k_all, v_all, self.key_start)
