"""Attention layer on CPU: ``selfattn.nn.MultiHeadAttention`` vs ``torch.nn.MultiheadAttention``.

Its code is :mod:`selfattn.benchmarks.layers`, which ships with the package
(``selfattn bench --only layers`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.layers import main

if __name__ == "__main__":
    sys.exit(main())
