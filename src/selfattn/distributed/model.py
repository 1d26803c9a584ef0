"""Run a ``selfattn.nn`` model context-parallel: its self-attention goes through the ring.

Everything in a transformer but attention is position-wise, so a model runs on a sequence shard
unchanged once (1) its inputs are sharded (:func:`shard_sequence`), (2) RoPE rotates each row at
its GLOBAL position (:func:`position_ids`) and (3) self-attention sees the whole sequence
(:func:`ring_attention`). :func:`context_parallel` does (2) and (3) in place::

    model = context_parallel(model, group, layout="zigzag")
    x_local = shard_sequence(x, "zigzag", group)           # (B, S/W, d_model)
    y = unshard_sequence(model(x_local), "zigzag", group)  # == model(x) on one rank
"""

from __future__ import annotations

from torch import nn

from selfattn.distributed.checks import rank_checks
from selfattn.distributed.ring import RING_CHECKS, prepare, run, summary
from selfattn.distributed.shard import check_layout, position_ids, world
from selfattn.nn import MultiHeadAttention

__all__ = ["ContextParallelAttention", "context_parallel"]


class ContextParallelAttention(nn.Module):
    """A :class:`selfattn.nn.MultiHeadAttention` (self-attention) computed by ring attention.

    Shares the wrapped module's parameters. Takes this rank's shard ``x (B, S/W, d_model)`` and
    returns ``(B, S/W, d_model)``; ``positions`` default to the shard's global positions.
    """

    def __init__(self, attn: MultiHeadAttention, group=None, layout: str = "zigzag", **ring_kwargs):
        super().__init__()
        self.attn, self.group, self.layout = attn, group, check_layout(layout)
        self.ring_kwargs = ring_kwargs  # method=, backend= for ring_attention

    def forward(
        self, x, context=None, *, mask=None, score_mod=None, positions=None, cache=None, **kw
    ):
        a, W = self.attn, world(self.group)[0]
        # every check (and the projections, which fail on a wrong d_model) runs before the
        # ring's first collective, agreed across ranks in one exchange (see ring_attention)
        with rank_checks(
            "context-parallel attention", self.group, W, *RING_CHECKS, tensor=x
        ) as check:
            unsupported = {"context": context, "cache": cache, **kw}
            given = sorted(name for name, val in unsupported.items() if val not in (None, False))
            if given:
                raise ValueError(
                    f"context-parallel attention is causal/bidirectional self-attention over a "
                    f"sharded sequence; it does not take {given} (decode with a cache on one rank "
                    "instead)"
                )
            if a.training and a.dropout > 0:
                raise ValueError(
                    f"ring_attention has no dropout; the wrapped attention has dropout="
                    f"{a.dropout} in training mode: set dropout=0 or call .eval()"
                )
            if x.dim() != 3 or x.shape[-1] != a.d_model:
                raise ValueError(
                    f"context-parallel attention takes this rank's shard x (B, S/W, d_model="
                    f"{a.d_model}), got shape {tuple(x.shape)}"
                )
            B, Sl, _ = x.shape
            if a.rope is not None and positions is None:
                positions = position_ids(Sl * W, self.layout, self.group, device=x.device)
            q, k, v = a.heads_qkv(x, positions=positions)  # rotated at global positions
            cfg = prepare(
                q, k, v, group=self.group, mask=mask, score_mod=a.score_mod_for(score_mod),
                scale=a.scale, layout=self.layout, **self.ring_kwargs,
            )  # fmt: skip
            check.summary = summary(q, k, v, cfg)
        out = run(q, k, v, cfg, return_lse=False)
        out = out.transpose(1, 2).reshape(B, Sl, -1)  # (B, Hq, S/W, Dv) -> (B, S/W, Hq·Dv)
        return a.project_out(out, x)


def context_parallel(model: nn.Module, group=None, layout: str = "zigzag", **ring_kwargs):
    """Wrap every self-attention of ``model`` (in place) in :class:`ContextParallelAttention`.

    A block's ``self_attention`` / ``attention`` child is wrapped; cross-attention (whose keys
    are an encoder output, not the sharded sequence) is left alone. Returns ``model``.
    """
    check_layout(layout)
    for module in list(model.modules()):
        for name in ("self_attention", "attention"):
            child = getattr(module, name, None)
            if isinstance(child, MultiHeadAttention):
                setattr(module, name, ContextParallelAttention(child, group, layout, **ring_kwargs))
    return model
