"""Serving through HTTP: concurrent streaming openai clients against `selfattn serve`, against
the offline engine's tokens/s.

Its code is :mod:`selfattn.benchmarks.serving_http`, which ships with the package
(``selfattn bench --only serving_http`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.serving_http import main

if __name__ == "__main__":
    sys.exit(main())
