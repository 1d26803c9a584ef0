"""What the Engine holds per request while it prefills a prompt it will compress.

Its code is :mod:`selfattn.benchmarks.kv_prefill`, which ships with the package
(``selfattn bench --only kv_prefill`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.kv_prefill import main

if __name__ == "__main__":
    sys.exit(main())
