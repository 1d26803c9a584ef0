"""Batch invariance on this machine (torch's matmul, the quantised matmul, the paged decode
kernel, alone vs in a batch) and deterministic mode's decode-step cost.

Its code is :mod:`selfattn.benchmarks.determinism`, which ships with the package
(``selfattn bench --only determinism`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.determinism import main

if __name__ == "__main__":
    sys.exit(main())
