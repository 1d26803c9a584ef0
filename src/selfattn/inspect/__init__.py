"""Seeing attention: capture per-layer, per-head maps, summarise heads, draw heatmaps and masks;
attribute beyond one map (rollout, flow, attention x gradient, head importance); the textbook
worked example and the backends' capability matrix as plain numbers.

>>> from selfattn.inspect import capture_attention, head_stats_table, plot_attention
>>> with capture_attention(model, layers=[0]) as maps:              # doctest: +SKIP
...     model(input_ids)
>>> plot_attention(maps[0][0], tokens, out="layer0.png")            # doctest: +SKIP

matplotlib is imported only when something is plotted.
"""

from selfattn.inspect.attribution import (
    attention_flow,
    attention_gradients,
    attention_rollout,
    head_importance,
    mask_heads,
    residual_attention,
)
from selfattn.inspect.backend_matrix import (
    backend_availability,
    capability_matrix,
    matrix_markdown,
)
from selfattn.inspect.capture import AttentionMaps, attention_layers, capture_attention
from selfattn.inspect.hooks import (
    ActivationCache,
    HookPoint,
    RequestHooks,
    hook_points,
    hooks,
    mean_ablation,
    patch,
    resample_ablation,
    steer,
    zero_ablation,
)
from selfattn.inspect.mask_expr import MaskSyntaxError, parse_mask
from selfattn.inspect.plot import plot_attention, plot_mask, plot_patching
from selfattn.inspect.stats import head_stats, head_stats_table
from selfattn.inspect.view import circuits_section, view_section, write_view
from selfattn.inspect.worked_example import worked_example

__all__ = [
    "ActivationCache",
    "AttentionMaps",
    "HookPoint",
    "MaskSyntaxError",
    "RequestHooks",
    "attention_flow",
    "attention_gradients",
    "attention_layers",
    "attention_rollout",
    "backend_availability",
    "capability_matrix",
    "capture_attention",
    "circuits_section",
    "head_importance",
    "head_stats",
    "head_stats_table",
    "hook_points",
    "hooks",
    "mask_heads",
    "matrix_markdown",
    "mean_ablation",
    "parse_mask",
    "patch",
    "plot_attention",
    "plot_mask",
    "plot_patching",
    "resample_ablation",
    "residual_attention",
    "steer",
    "view_section",
    "worked_example",
    "write_view",
    "zero_ablation",
]
