"""What a fresh Python process costs before an actor runs in it: interpreter start and
imports, timed from outside with ``python -c``, and the imports split by package.

The suites that start processes run them with a private, warmed bytecode cache
(``bytecode_env``): an installed package has its ``.pyc`` files, so that is what a user's
actor process gets, whether or not this environment sets ``PYTHONDONTWRITEBYTECODE`` or
the source tree is writable. ``as_given_env`` is the environment untouched (but for
``PYTHONPATH``), for comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ._proc import BenchmarkError

#: The module an actor process of the lifecycle suites imports on top of ``runtime._child``.
ACTOR_MODULE = "benchmarks._lifecycle_actors"
#: Everything an actor process of those suites imports (``python -m runtime._child``).
CHILD_IMPORTS = f"import runtime._child, {ACTOR_MODULE}"
#: Packages the import profile names; a module outside them counts for its importer.
NAMED = ("runtime", "asyncio", "zmq", "msgspec", "anyio")
_TIMEOUT = 60.0


def as_given_env() -> dict[str, str]:
    """This process's environment, with ``benchmarks`` and ``runtime`` importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def bytecode_env(workdir: str) -> dict[str, str]:
    """``as_given_env`` reading bytecode from a private cache under ``workdir``, warmed here.

    ``PYTHONPYCACHEPREFIX`` keeps the ``.pyc`` files out of the source tree. The warm-up
    compiles what a driver imports and what an actor process imports, its event loop's
    lazy imports included (it spawns one); the processes started with the environment
    returned (and the actor processes they spawn, which inherit it) only read the cache,
    so none writes into ``workdir`` while, or after, the suite removes it.
    """
    env = as_given_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(Path(workdir) / "pycache")
    warm = f"{CHILD_IMPORTS}, benchmarks._restart, benchmarks._spawning"
    _run([sys.executable, "-c", warm], env)
    spawn_one = ("spawn-ready", "--count", "1", "--profiles", "0")
    _run([sys.executable, "-m", "benchmarks._restart", *spawn_one], env)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def bytecode_cached_by_default() -> bool:
    """Whether this environment lets Python write the bytecode cache of ``runtime``."""
    return not os.environ.get("PYTHONDONTWRITEBYTECODE") or bool(
        os.environ.get("PYTHONPYCACHEPREFIX")
    )


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    try:
        done = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            timeout=_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"{' '.join(cmd)} took more than {_TIMEOUT:g} s") from None
    if done.returncode != 0:
        text = done.stderr.decode(errors="replace")[-2000:]
        raise BenchmarkError(f"{' '.join(cmd)} exited with status {done.returncode}:\n{text}")
    return done


def time_python(code: str, env: dict[str, str]) -> float:
    """Milliseconds from starting ``python -c code`` until ``code`` has run.

    The process reports on stdout when it gets there; its exit is not timed, as an actor
    process does not exit before it serves.
    """
    script = f"{code}\nimport sys\nsys.stdout.write('.')\nsys.stdout.flush()"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        got = proc.stdout.read(1)
        elapsed = round((time.perf_counter() - t0) * 1000, 3)
        if got == b".":
            proc.kill()  # its exit is not measured: do not wait for it
        _, err = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"python -c {code!r} took more than {_TIMEOUT:g} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if got != b".":
        text = err.decode(errors="replace")[-2000:]
        raise BenchmarkError(f"python -c {code!r} exited with status {proc.returncode}:\n{text}")
    return elapsed


def parse_importtime(text: str) -> list[tuple[int, str, float]]:
    """``-X importtime`` output: (depth, module, self ms) per import, in print order (a
    module after the modules it imported); other lines are skipped."""
    out: list[tuple[int, str, float]] = []
    for line in text.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if not line.startswith("import time:") or len(fields) != 3:
            continue
        if not fields[0].strip().isdigit():
            continue  # the header
        name = fields[2].rstrip()
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        out.append((depth, name.strip(), int(fields[0]) / 1000))
    return out


def startup_modules(env: dict[str, str]) -> set[str]:
    """The modules a bare interpreter imports on its own (``python -c pass``)."""
    err = _run([sys.executable, "-X", "importtime", "-c", "pass"], env).stderr.decode()
    return {module for _, module, _ in parse_importtime(err)}


def group_of(module: str) -> str | None:
    """The profile group a module names itself (``None``: it belongs to its importer's)."""
    top = module.partition(".")[0]
    if top in NAMED:
        return top
    if top == ACTOR_MODULE.partition(".")[0]:
        return "actor module"
    return None


def by_group(lines: list[tuple[int, str, float]], startup: set[str]) -> dict[str, float]:
    """Import self times (ms) summed by group, interpreter start (``startup``) left out.

    A module outside the named groups counts for the nearest importer in one (``ssl`` for
    ``asyncio``, ``logging`` for ``runtime``), else as stdlib or third-party.
    """
    groups: dict[str, float] = {}
    stack: list[tuple[int, str | None]] = []
    for depth, module, ms in reversed(lines):  # reversed: each importer before its imports
        while stack and stack[-1][0] >= depth:
            stack.pop()
        group = group_of(module) or (stack[-1][1] if stack else None)
        stack.append((depth, group))
        if module in startup:
            continue
        if group is None:
            top = module.partition(".")[0]
            group = "other stdlib" if top in sys.stdlib_module_names else "other third-party"
        groups[group] = groups.get(group, 0.0) + ms
    return groups


def kill_to_reaped(code: str, env: dict[str, str]) -> float:
    """Milliseconds from SIGKILL of an idle ``python -c code`` process until it can be
    reaped: the kernel's part of noticing a death, with no runtime involved."""
    script = f"{code}\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise BenchmarkError(f"python -c {code!r} exited with status {proc.wait()}")
        time.sleep(0.05)  # idle, like an actor waiting for mail
        t0 = time.perf_counter()
        proc.kill()
        proc.wait()  # blocking waitpid: with a timeout, Popen.wait polls with sleeps
        return round((time.perf_counter() - t0) * 1000, 3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
