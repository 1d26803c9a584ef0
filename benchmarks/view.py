"""The attention explorer page at 12 layers x 12 heads x 256 tokens: size, write and render time.

Its code is :mod:`selfattn.benchmarks.view`, which ships with the package
(``selfattn bench --only view`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.view import main

if __name__ == "__main__":
    sys.exit(main())
