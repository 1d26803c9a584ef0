"""Ring attention on W local processes against one process: time, bytes, memory, balance.

Its code is :mod:`selfattn.benchmarks.ring`, which ships with the package
(``selfattn bench --only ring`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.ring import main

if __name__ == "__main__":
    sys.exit(main())
