"""Entry points that plug selfattn into other libraries.

- :mod:`selfattn.integrations.transformers`: ``attn_implementation="selfattn"`` for
  transformers models (importing it registers the name).

Nothing here is imported by ``import selfattn``: each integration loads its library only when
the integration itself is imported.
"""
