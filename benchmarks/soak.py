"""Soak: thousands of mixed requests against ``selfattn serve``, then the books checked.

Its code is :mod:`selfattn.benchmarks.soak`, which ships with the package (``selfattn bench
--only soak`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.soak import main

if __name__ == "__main__":
    sys.exit(main())
