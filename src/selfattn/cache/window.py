"""``SlidingWindowCache``: a ring buffer holding the last ``window`` tokens of each layer."""

from __future__ import annotations

import torch

from selfattn.nn.attention import _positive_int

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
    bottom-right ``q_offset`` lines them up with their own keys; the window mask (and ALiBi, and
    any mask or score that depends only on ``q_idx - kv_idx``) then gives the full-sequence
    result. ``key_start`` is the absolute position of the first returned key, for masks that
    need absolute positions (add it to ``kv_idx``). Other masks (plain causal) would see a
    truncated history: this cache is for windowed attention only.
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
        for name, x in (
            ("batch", batch),
            ("window", window),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            _positive_int(x, f"SlidingWindowCache {name}")
        value_dim = (
            head_dim
            if value_dim is None
            else _positive_int(value_dim, "SlidingWindowCache value_dim")
        )
        self.k = torch.zeros(batch, n_kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, n_kv_heads, window, value_dim, dtype=dtype, device=device)
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

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None):
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` at absolute positions ``length ..``.

        ``positions`` (optional, ``(S,)`` ints) must be those next ``S`` positions: a ring buffer
        only appends. Returns ``(k_all, v_all)`` of shapes ``(B, Hkv, n + S, D)`` and
        ``(B, Hkv, n + S, Dv)`` with ``n = min(length, window - 1)`` old tokens first; new
        tensors, not views of the ring (their order differs from the ring's after wrap-around).
        """
        B, H, W, D = self.k.shape
        S = k.shape[2] if k.dim() == 4 else -1
        if k.dim() != 4 or tuple(k.shape) != (B, H, S, D):
            raise ValueError(
                f"cache expects k of shape (B={B}, Hkv={H}, S, D={D}), got {tuple(k.shape)}; "
                "build the cache with the model's batch, n_kv_heads and head_dim"
            )
        want_v = (B, H, S, self.v.shape[3])
        if tuple(v.shape) != want_v:
            raise ValueError(
                f"cache expects v of shape {want_v} (matching k), got {tuple(v.shape)}"
            )
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
        return k_all, v_all
