"""Decode over a paged KV cache on CPU: ``selfattn.cache.paged_attention`` vs SDPA.

Its code is :mod:`selfattn.benchmarks.decode`, which ships with the package
(``selfattn bench --only decode`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.decode import main

if __name__ == "__main__":
    sys.exit(main())
