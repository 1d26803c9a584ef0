"""``LayerCaches``: a model's cache made of one independent cache per layer (static, window)."""

from __future__ import annotations

from selfattn.cache.base import Step, next_position, next_positions

__all__ = ["LayerCaches"]


class LayerCaches:
    """One KV cache per layer (:class:`~selfattn.cache.base.ModelKVCache`; what
    ``CausalLM.make_cache("static" | "window")`` returns: pass it back as ``cache=``).

    ``layers[i]`` follows the layer contract (:class:`~selfattn.cache.base.KVCache`) and updates
    itself inside its layer, so :meth:`plan` has no bookkeeping to do: it hands out the layers
    and the new tokens' positions ``position + arange(S)`` on ``device``. ``length`` is the
    number of cached token positions (padding included), the same for every layer; after KV
    compression (``StaticCache.compact``) it is layer 0's slots used (layers may keep different
    numbers) and ``position``, the tokens seen, runs ahead of it.
    """

    def __init__(self, kind: str, layers: list, device=None):
        self.kind, self.layers, self.device = kind, layers, device

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def position(self) -> int:
        """The next token's position (tokens seen): ``length`` unless compression evicted some."""
        return next_position(self.layers[0])

    def __len__(self) -> int:
        return self.length

    def plan(self, n_tokens: int) -> Step:
        n = self.position
        return Step(self.layers, next_positions(n, n_tokens, self.device), n)

    def reset(self) -> None:
        for c in self.layers:
            c.reset()

    def __repr__(self) -> str:
        return f"LayerCaches({self.kind!r}, layers={len(self.layers)}, length={self.length})"
