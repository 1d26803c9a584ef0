"""Attention-based head importance against causal effect (the seed's "Attention is not
Explanation", measured).

Its code is :mod:`selfattn.benchmarks.attention_claim`, which ships with the package
(``selfattn bench --only attention_claim`` runs it from an installed wheel); this is its entry
point.
"""

import sys

from selfattn.benchmarks.attention_claim import main

if __name__ == "__main__":
    sys.exit(main())
