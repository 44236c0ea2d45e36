"""``python -m runtime top``: a live view of a running system (see `runtime._top`)."""

from __future__ import annotations

import sys

from ._top import main

USAGE = "usage: python -m runtime top --credentials PATH [--interval S] [--once]\n"

if __name__ == "__main__":
    if sys.argv[1:2] != ["top"]:
        sys.stderr.write(USAGE)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
