"""Other libraries' calling conventions on :func:`selfattn.attention`, for code written for them.

- :mod:`selfattn.compat.flash_attn`: flash-attn's ``flash_attn_func``, ``flash_attn_varlen_func``
  and ``flash_attn_with_kvcache`` (its layouts, keywords and documented semantics).

FlexAttention needs no module here: ``selfattn.attention`` takes its ``mask_mod`` / ``score_mod``
callables and ``BlockMask`` objects as they are, and every selfattn mask has ``to_block_mask``.
"""
