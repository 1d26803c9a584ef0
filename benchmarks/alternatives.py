"""Attention and its alternatives (Mamba-2, gated DeltaNet, a hybrid): cost per token vs context
length and MQAR recall.

Its code is :mod:`selfattn.benchmarks.alternatives`, which ships with the package; this is its
entry point (``selfattn compare --out DIR`` adds the plots).
"""

import sys

from selfattn.benchmarks.alternatives import main

if __name__ == "__main__":
    sys.exit(main())
