"""``python -m benchmarks``: see ``python -m benchmarks --help``."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
