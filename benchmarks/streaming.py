"""StreamingLLM sink tokens past the trained length: bounded memory and per-token time, perplexity
against plain windowing and full attention.

Its code is :mod:`selfattn.benchmarks.streaming`, which ships with the package
(``selfattn bench --only streaming`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.streaming import main

if __name__ == "__main__":
    sys.exit(main())
