"""The benchmarks' helpers (:mod:`selfattn.benchmarks._util`) for the scripts in this folder."""

from selfattn.benchmarks._util import *  # noqa: F403
from selfattn.benchmarks._util import __all__  # noqa: F401
