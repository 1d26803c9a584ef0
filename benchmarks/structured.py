"""Structured output: the grammar engines' costs, and guided against free generation in the Engine.

Its code is :mod:`selfattn.benchmarks.structured`, which ships with the package
(``selfattn bench --only structured`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.structured import main

if __name__ == "__main__":
    sys.exit(main())
