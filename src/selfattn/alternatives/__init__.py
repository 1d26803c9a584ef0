"""selfattn.alternatives: attention's alternatives with a fixed-size state.

Plain causal linear attention, Mamba-2's SSD mixer and gated DeltaNet, each a chunked parallel
form (prefill, training) and a recurrent form (decode) of one scan (:mod:`.scan`), with their
state kept per sequence in a :class:`~selfattn.cache.state.LayerState`.
"""

from selfattn.alternatives.layers import (
    GatedDeltaNet,
    GatedRMSNorm,
    LinearAttention,
    Mamba2Mixer,
    RecurrentMixer,
    causal_conv,
)
from selfattn.alternatives.scan import chunked_scan, recurrent_scan, scan_step

__all__ = [
    "GatedDeltaNet",
    "GatedRMSNorm",
    "LinearAttention",
    "Mamba2Mixer",
    "RecurrentMixer",
    "causal_conv",
    "chunked_scan",
    "recurrent_scan",
    "scan_step",
]
