"""Multi-head latent attention decode: absorbed vs naive order, and the latent cache's size.

Its code is :mod:`selfattn.benchmarks.mla`, which ships with the package; this is its entry
point.
"""

import sys

from selfattn.benchmarks.mla import main

if __name__ == "__main__":
    sys.exit(main())
