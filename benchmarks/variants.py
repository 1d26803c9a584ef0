"""The cost of the attention variants (sinks, ...) against the same call without them.

Its code is :mod:`selfattn.benchmarks.variants`, which ships with the package (one function per
variant in its ``SECTIONS``); this is its entry point.
"""

import sys

from selfattn.benchmarks.variants import main

if __name__ == "__main__":
    sys.exit(main())
