"""Speculative decoding by prompt lookup against plain greedy decoding (generate and the Engine).

Its code is :mod:`selfattn.benchmarks.speculative`, which ships with the package
(``selfattn bench --only speculative`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.speculative import main

if __name__ == "__main__":
    sys.exit(main())
