"""Attention on CPU: selfattn (``backend="auto"``) against its peers, measured in one run.

Its code is :mod:`selfattn.benchmarks.attention`, which ships with the package
(``selfattn bench --only attention`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.attention import main

if __name__ == "__main__":
    sys.exit(main())
