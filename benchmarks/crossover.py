"""Where the fused C kernel beats SDPA on CPU (no mask, causal; forward and forward + backward),
and what ``auto`` picks: cpu_fused, sdpa and chunked over a grid of shapes.

Its code is :mod:`selfattn.benchmarks.crossover`, which ships with the package; this is its entry
point.
"""

import sys

from selfattn.benchmarks.crossover import main

if __name__ == "__main__":
    sys.exit(main())
