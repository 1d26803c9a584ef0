"""Seeing attention: capture per-layer, per-head maps, summarise heads, draw heatmaps and masks;
the textbook worked example and the backends' capability matrix as plain numbers.

>>> from selfattn.inspect import capture_attention, head_stats_table, plot_attention
>>> with capture_attention(model, layers=[0]) as maps:              # doctest: +SKIP
...     model(input_ids)
>>> plot_attention(maps[0][0], tokens, out="layer0.png")            # doctest: +SKIP

matplotlib is imported only when something is plotted.
"""

from selfattn.inspect.backend_matrix import (
    backend_availability,
    capability_matrix,
    matrix_markdown,
)
from selfattn.inspect.capture import AttentionMaps, capture_attention
from selfattn.inspect.mask_expr import MaskSyntaxError, parse_mask
from selfattn.inspect.plot import plot_attention, plot_mask
from selfattn.inspect.stats import head_stats, head_stats_table
from selfattn.inspect.worked_example import worked_example

__all__ = [
    "AttentionMaps",
    "MaskSyntaxError",
    "backend_availability",
    "capability_matrix",
    "capture_attention",
    "head_stats",
    "head_stats_table",
    "matrix_markdown",
    "parse_mask",
    "plot_attention",
    "plot_mask",
    "worked_example",
]
