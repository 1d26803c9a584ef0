"""The server against its own OpenAPI document (Schemathesis): every answer as documented.

Its code is :mod:`selfattn.benchmarks.schema_fuzz`, which ships with the package (``selfattn
bench --only schema_fuzz`` runs it from an installed wheel); this is its entry point.
"""

import sys

from selfattn.benchmarks.schema_fuzz import main

if __name__ == "__main__":
    sys.exit(main())
