"""``python -m runtime top`` (a live view of a running system, `runtime._top`) and
``python -m runtime node`` (a node of a system on another host, `runtime._nodemain`)."""

from __future__ import annotations

import sys

USAGE = (
    "usage: python -m runtime top --credentials PATH [--interval S] [--once]\n"
    "       python -m runtime node --system ADDRESS --keys DIR --name NAME --host HOST\n"
)

if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["top"]:
        from ._top import main

        sys.exit(main(sys.argv[2:]))
    if command == ["node"]:
        from ._nodemain import node_main

        sys.exit(node_main(sys.argv[2:]))
    sys.stderr.write(USAGE)
    sys.exit(2)
