"""GPU checks and speed of selfattn on one CUDA device: correctness per backend, then speed.

Its code is :mod:`selfattn.benchmarks.gpu`, which ships with the package
(``selfattn bench --only gpu`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.gpu import main

if __name__ == "__main__":
    sys.exit(main())
