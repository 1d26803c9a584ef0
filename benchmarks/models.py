"""Whole models on CPU in fp32: our loaded models vs transformers / sentence-transformers.

Its code is :mod:`selfattn.benchmarks.models`, which ships with the package
(``selfattn bench --only models`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.models import main

if __name__ == "__main__":
    sys.exit(main())
