"""``python -m selfattn``: the ``selfattn`` command."""

import sys

from selfattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
