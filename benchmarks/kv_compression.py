"""KV-cache compression on retrieval: each policy, ours beside kvpress.

Its code is :mod:`selfattn.benchmarks.kv_compression`, which ships with the package
(``selfattn bench --only kv_compression`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.kv_compression import main

if __name__ == "__main__":
    sys.exit(main())
