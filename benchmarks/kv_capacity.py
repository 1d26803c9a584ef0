"""KV compression's capacity: requests at once and tokens/s of the Engine, compressed or not.

Its code is :mod:`selfattn.benchmarks.kv_capacity`, which ships with the package
(``selfattn bench --only kv_capacity`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.kv_capacity import main

if __name__ == "__main__":
    sys.exit(main())
