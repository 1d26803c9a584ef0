"""Where one decode step of our decoder spends its time: matrix products, attention, the rest.

Its code is :mod:`selfattn.benchmarks.decode_step`, which ships with the package
(``selfattn bench --only decode_step`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.decode_step import main

if __name__ == "__main__":
    sys.exit(main())
