"""Serving many requests on CPU: selfattn's Engine against transformers, same weights and threads.

Its code is :mod:`selfattn.benchmarks.serving`, which ships with the package
(``selfattn bench --only serving`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.serving import main

if __name__ == "__main__":
    sys.exit(main())
