"""Loading a GGUF file: wall time and peak RSS, ours against transformers' loader and llama.cpp.

Its code is :mod:`selfattn.benchmarks.gguf_model`, which ships with the package
(``selfattn bench --only gguf_model`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.gguf_model import main

if __name__ == "__main__":
    sys.exit(main())
