"""Models built from selfattn's parts, and loading of transformers-format checkpoints.

``from_pretrained(path)`` reads ``config.json`` + ``*.safetensors`` into the family registered for
the config's ``model_type`` (see :mod:`selfattn.models.hub`); ``generate`` runs any causal LM or
encoder-decoder through one of the library's KV caches.
"""

from selfattn.models.hub import (
    CheckpointError,
    ConfigKeyError,
    UnsupportedConfigError,
    from_pretrained,
)

from selfattn.models.encoder import BertConfig, BertModel, SentenceEncoder  # isort: skip
from selfattn.models.decoder import GPT2, CausalLM, DecoderConfig, LayerCaches, Llama  # isort: skip
from selfattn.models.generate import generate, next_token  # isort: skip
from selfattn.models.graph import GATLayer  # isort: skip
from selfattn.models.seq2seq import T5, Bart  # isort: skip
from selfattn.models.vision import SwinBlock, ViT, ViTConfig  # isort: skip

__all__ = [
    "GPT2",
    "T5",
    "Bart",
    "BertConfig",
    "BertModel",
    "CausalLM",
    "CheckpointError",
    "ConfigKeyError",
    "DecoderConfig",
    "GATLayer",
    "LayerCaches",
    "Llama",
    "SentenceEncoder",
    "SwinBlock",
    "UnsupportedConfigError",
    "ViT",
    "ViTConfig",
    "from_pretrained",
    "generate",
    "next_token",
]
