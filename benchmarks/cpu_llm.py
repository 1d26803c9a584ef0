"""A small chat model on a CPU against llama.cpp, vLLM's CPU build and transformers.

Its code is :mod:`selfattn.benchmarks.cpu_llm`, which ships with the package
(``selfattn bench --only cpu_llm`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.cpu_llm import main

if __name__ == "__main__":
    sys.exit(main())
