"""Models built from selfattn's parts, and loading of transformers-format checkpoints.

``from_pretrained(path)`` reads ``config.json`` + ``*.safetensors`` into the family registered for
the config's ``model_type`` (see :mod:`selfattn.models.hub`).
"""

from selfattn.models.hub import from_pretrained

from selfattn.models.graph import GATLayer  # isort: skip
from selfattn.models.vision import SwinBlock, ViT, ViTConfig  # isort: skip

__all__ = ["GATLayer", "SwinBlock", "ViT", "ViTConfig", "from_pretrained"]
