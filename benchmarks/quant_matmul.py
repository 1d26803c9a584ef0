"""Quantised matmuls at decode sizes (our C kernel, PyTorch's int4/int8 ops, dense matmuls) and
SmolLM2 decode speed and perplexity with quantised weights.

Its code is :mod:`selfattn.benchmarks.quant_matmul`, which ships with the package
(``selfattn bench --only quant_matmul`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.quant_matmul import main

if __name__ == "__main__":
    sys.exit(main())
