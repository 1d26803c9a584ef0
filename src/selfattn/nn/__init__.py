"""Modules: ``MultiHeadAttention`` (+ its ``ContiguousCache`` and torch drop-in),
``DiffAttention``, norms, MLPs, encoder and decoder blocks, and linear / embedding layers
that keep GGML block-quantised weights quantised (``nn.quant``). Inputs and outputs are
``(B, S, d_model)``."""

from selfattn.nn.attention import ContiguousCache, MultiHeadAttention, TorchMultiheadAttention
from selfattn.nn.blocks import DecoderBlock, EncoderBlock
from selfattn.nn.diff_attention import DiffAttention
from selfattn.nn.latent import LatentAttention
from selfattn.nn.mlp import MLP, SwiGLU
from selfattn.nn.norms import LayerNorm, RMSNorm
from selfattn.nn.quant import QuantizedEmbedding, QuantizedLinear

__all__ = [
    "MLP",
    "ContiguousCache",
    "DecoderBlock",
    "DiffAttention",
    "EncoderBlock",
    "LatentAttention",
    "LayerNorm",
    "MultiHeadAttention",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "RMSNorm",
    "SwiGLU",
    "TorchMultiheadAttention",
]
