"""``python -m runtime top`` (a live view of a running system, `runtime.top`) and
``python -m runtime node`` (a node of a system on another host, `runtime._nodemain`)."""

from __future__ import annotations

import sys

USAGE = "usage: python -m runtime {top,node} [options]\n"
HELP = (
    USAGE
    + """
commands:
  top   a live view of a running system: every actor's mailbox, rates, handler times,
        CPU, memory and restarts (python -m runtime top --help: its options)
  node  a node of a system on another host, until told to stop
        (python -m runtime node --help: its options)
"""
)


def main(argv: list[str]) -> int:
    """Run the command ``argv`` names; print the usage for ``--help`` (status 0) or for
    no command or an unknown one (status 2, as argparse does)."""
    command = argv[:1]
    if command == ["top"]:
        from .top import main as top_main

        return top_main(argv[1:])
    if command == ["node"]:
        from ._nodemain import node_main

        return node_main(argv[1:])
    if command in (["-h"], ["--help"]):
        sys.stdout.write(HELP)
        return 0
    problem = f"unknown command {command[0]!r}" if command else "a command is required"
    sys.stderr.write(f"{HELP}\npython -m runtime: error: {problem}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
