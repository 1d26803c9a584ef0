"""Models built from selfattn's parts, and loading of transformers-format checkpoints.

``from_pretrained(path_or_repo_id)`` reads ``config.json`` + ``*.safetensors`` into the family
registered for the config's ``model_type`` (see :mod:`selfattn.models.hub`; transformers' names
are mapped in :mod:`selfattn.models.hf_mapping`), or a GGUF file (:mod:`selfattn.models.gguf`;
``save_pretrained`` writes one back out as a transformers folder); ``load_tokenizer`` reads its
tokenizer and chat template; ``generate`` runs any causal LM or encoder-decoder through one of
the library's KV caches, on ids or on text.
"""

from selfattn.models.hub import (
    CheckpointError,
    ConfigKeyError,
    UnsupportedConfigError,
    from_pretrained,
)

from selfattn.models.encoder import BertConfig, BertModel, SentenceEncoder  # isort: skip
from selfattn.models.decoder import GPT2, CausalLM, DecoderConfig, LayerCaches, Llama  # isort: skip
from selfattn.models.llama4 import Llama4  # isort: skip
from selfattn.models.generate import generate, next_token  # isort: skip
from selfattn.models.gguf import GGUFError, save_pretrained  # isort: skip
from selfattn.models import hf_quant  # noqa: F401  # isort: skip  (registers AWQ, GPTQ, ...)
from selfattn.models.graph import GATLayer  # isort: skip
from selfattn.models.seq2seq import T5, Bart  # isort: skip
from selfattn.models.tokenizer import Tokenizer, load_tokenizer  # isort: skip
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
    "GGUFError",
    "LayerCaches",
    "Llama",
    "Llama4",
    "SentenceEncoder",
    "SwinBlock",
    "Tokenizer",
    "UnsupportedConfigError",
    "ViT",
    "ViTConfig",
    "from_pretrained",
    "generate",
    "load_tokenizer",
    "next_token",
    "save_pretrained",
]
