"""selfattn's hook points against TransformerLens's on the same weights (the ratio rule).

Its code is :mod:`selfattn.benchmarks.lens_parity`, which ships with the package
(``selfattn bench --only lens_parity`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.lens_parity import main

if __name__ == "__main__":
    sys.exit(main())
