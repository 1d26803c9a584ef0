"""ALiBi slopes (Press et al. 2021), shared with :func:`selfattn.scores.alibi`.

The bias itself is a score mod (``selfattn.scores.alibi(n_heads)``); this module re-exports the
slopes so that position schemes are found in one place. One implementation lives in scores.py.
"""

from selfattn.scores import alibi_slopes

__all__ = ["alibi_slopes"]
