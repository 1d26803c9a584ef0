"""Modules: ``MultiHeadAttention`` (+ its ``ContiguousCache`` and torch drop-in),
``DiffAttention``, norms, MLPs, encoder and decoder blocks. Inputs and outputs are
``(B, S, d_model)``."""

from selfattn.nn.attention import ContiguousCache, MultiHeadAttention, TorchMultiheadAttention
from selfattn.nn.blocks import DecoderBlock, EncoderBlock
from selfattn.nn.diff_attention import DiffAttention
from selfattn.nn.latent import LatentAttention
from selfattn.nn.mlp import MLP, SwiGLU
from selfattn.nn.norms import LayerNorm, RMSNorm

__all__ = [
    "MLP",
    "ContiguousCache",
    "DecoderBlock",
    "DiffAttention",
    "EncoderBlock",
    "LatentAttention",
    "LayerNorm",
    "MultiHeadAttention",
    "RMSNorm",
    "SwiGLU",
    "TorchMultiheadAttention",
]
