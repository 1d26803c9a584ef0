"""Models built on selfattn parts; see hub.from_pretrained."""

from selfattn.models.hub import from_pretrained

__all__ = ["from_pretrained"]
