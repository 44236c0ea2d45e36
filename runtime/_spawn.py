"""Starting actor processes (nothing pickled), and watching them from the event loop.

A child is a fresh interpreter (``python -m runtime._child``; no fork of a running loop),
or a fork of a preloaded fork server (`runtime._forking`), which is this process's child
all the same. Either way its spawn spec travels on its stdin as one msgspec message; the
pipe (a socket, for a forked child) then stays open so the child sees EOF if its parent
dies, on top of the Linux parent-death signal. Death is seen through a pidfd in the event
loop, not by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import os
import signal
import struct
import subprocess
import sys
import threading
import types
import typing
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from ._auth import Keys
from ._codec import encode_spawn_value
from ._errors import RemoteActorError, SpawnError, to_its_end
from ._message import type_path
from ._protocol import Header, Kind, ReadyBody, SpawnOptions, SpawnTarget, ready_decoder
from ._transport import TransportOptions, unwatch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence
    from types import ModuleType

_LENGTH = struct.Struct("!I")


class SpawnSpec(msgspec.Struct, kw_only=True):
    """Everything a child process needs to start one actor.

    Attributes:
        target: What to start.
        how: How its starter starts it (``inherit`` is read here, by the parent, for the
            descriptors the child gets).
        defaults: The options of the child's own spawns that name none (its system's).
        ipc_dir: The system's private directory.
        options: Transport settings.
        parent_reply: Address the child reports ready (or failed) to.
        token: Correlation id of that report.
        root_pid: Pid of the process owning the system directory.
        sys_path: The parent's ``sys.path``, so the same modules import.
        cwd: The parent's working directory.
        log_level: Root logging level to use.
        cookie: The system's secret, carried by every header.
        keys: The system's CURVE keys (tcp only).
        preload: What the child's own fork server preloads.
        root: The system root's reply inbox (tcp), where node names resolve.
        env: The environment to take (a forked child has its fork server's otherwise);
            ``None`` for a fresh interpreter, which is started with it.
    """

    target: SpawnTarget
    how: SpawnOptions
    defaults: SpawnOptions
    ipc_dir: str
    options: TransportOptions
    parent_reply: str
    token: int
    root_pid: int
    sys_path: list[str]
    cwd: str
    log_level: int
    cookie: bytes
    keys: Keys | None = None
    preload: list[str] = []
    env: dict[str, str] | None = None
    root: str = ""


def encode_arguments(
    cls: type, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[list[msgspec.Raw], dict[str, msgspec.Raw]]:
    """Encode spawn arguments one by one, in the caller, so a bad one fails here.

    Raises:
        SpawnError: An argument is not msgspec-encodable (there is no pickling fallback, ever).
    """
    try:
        enc_args = [
            msgspec.Raw(encode_spawn_value(v, f"argument {i} of {cls.__qualname__}"))
            for i, v in enumerate(args)
        ]
        enc_kwargs = {
            k: msgspec.Raw(encode_spawn_value(v, f"argument {k!r} of {cls.__qualname__}"))
            for k, v in kwargs.items()
        }
    except TypeError as err:
        raise SpawnError(
            f"cannot spawn {cls.__qualname__} in a process: {err}. Spawn arguments travel as "
            "msgspec values (structs, lists, dicts, str, int, ...); pass process=False to keep "
            "arbitrary objects in this process"
        ) from err
    return enc_args, enc_kwargs


def decode_arguments(
    cls: type, args: Sequence[msgspec.Raw], kwargs: Mapping[str, msgspec.Raw]
) -> tuple[list[Any], dict[str, Any]]:
    """Decode spawn arguments with the types ``cls.__init__`` annotates, where it does.

    Raises:
        TypeError: An argument does not decode as the type its parameter is annotated with,
            naming the parameter.
    """
    init: Any = cls.__init__  # type: ignore[misc]
    hints = _init_hints(init)
    params = [
        p
        for p in list(inspect.signature(init).parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]

    def decode(raw: msgspec.Raw, name: str | None) -> Any:
        hint = hints.get(name) if name is not None else None
        if hint is None:
            return msgspec.msgpack.decode(raw)
        try:
            return msgspec.msgpack.decode(raw, type=hint)
        except msgspec.ValidationError as err:
            raise TypeError(
                f"argument {name!r} of {cls.__qualname__} does not decode as its annotation "
                f"{_type_name(hint)}: {err}"
            ) from err

    out_args = [
        decode(raw, params[i].name if i < len(params) else None) for i, raw in enumerate(args)
    ]
    out_kwargs = {k: decode(raw, k) for k, raw in kwargs.items()}
    return out_args, out_kwargs


def _init_hints(init: Any) -> dict[str, Any]:
    """The resolved annotations of ``__init__``, each on its own: one that names a type not
    defined at run time (imported under ``TYPE_CHECKING`` only) leaves that parameter
    untyped, not all of them."""
    with contextlib.suppress(Exception):  # one unresolvable: resolve them one by one below
        return typing.get_type_hints(init)
    hints: dict[str, Any] = {}
    globalns = getattr(init, "__globals__", {})
    for name, annotation in getattr(init, "__annotations__", {}).items():
        one = types.SimpleNamespace(__annotations__={name: annotation})
        with contextlib.suppress(Exception):  # unresolvable: decode this one untyped
            hints[name] = typing.get_type_hints(one, globalns)[name]
    return hints


def _type_name(hint: Any) -> str:
    return getattr(hint, "__qualname__", None) or str(hint)


def main_reference(cls: type) -> str:
    """How a child re-imports ``__main__`` for a class defined there ('' otherwise).

    Raises:
        SpawnError: The class lives in an interactive ``__main__`` that has no file.
    """
    if cls.__module__ not in ("__main__", "__mp_main__"):
        return ""
    main = sys.modules["__main__"]
    main_spec = getattr(main, "__spec__", None)
    if main_spec is not None and main_spec.name not in ("__main__", "__mp_main__"):
        return f"module:{main_spec.name}"
    main_file = getattr(main, "__file__", None)
    if main_file is None:
        raise SpawnError(
            f"{cls.__qualname__} is defined in an interactive session; a child process cannot "
            "import it. Define it in a module or script file, or spawn with process=False"
        )
    return f"path:{os.path.abspath(main_file)}"


def actor_path(cls: type) -> str:
    """The import path of an actor class, checked to be importable from a child."""
    if "<locals>" in cls.__qualname__:
        raise SpawnError(
            f"{cls.__qualname__} is defined inside a function; a child process cannot import "
            "it. Define it at module level, or spawn with process=False"
        )
    return type_path(cls)


def _import_main(main: str) -> None:
    if "__mp_main__" in sys.modules:
        return  # already re-imported in this process
    kind, _, target = main.partition(":")
    if kind == "module":
        found = importlib.util.find_spec(target)
    else:
        found = importlib.util.spec_from_file_location("__mp_main__", target)
    if found is None or found.loader is None:
        raise ImportError(f"cannot re-import the main module {target!r}")
    module = importlib.util.module_from_spec(found)
    module.__name__ = "__mp_main__"
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    found.loader.exec_module(module)


def resolve_class(path: str, main: str) -> type:
    """Import ``module:QualName``, re-importing ``__main__`` first when it lives there."""
    module_name, _, qualname = path.partition(":")
    if main:
        _import_main(main)
    module: ModuleType = (
        sys.modules["__main__"]
        if module_name == "__main__"
        else importlib.import_module(module_name)
    )
    obj: object = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{path} is not a class")
    return obj


class Process(Protocol):
    """What `ChildProcess` uses of a started process: ``subprocess.Popen``'s interface,
    which ``runtime._forking.ForkedProcess`` has too."""

    @property
    def pid(self) -> int:
        """The process id."""
        ...

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped (negative: the signal), else None."""
        ...

    @property
    def stdin(self) -> _Closeable | None:
        """This end of the child's stdin."""
        ...

    def wait(self) -> int:
        """Reap the process (blocking) and return its status."""
        ...

    def send_signal(self, signum: int) -> None:
        """Signal the process."""
        ...


class _Closeable(Protocol):
    def close(self) -> None: ...


class ChildProcess:
    """One actor process: start it, watch it die, signal it.

    Args:
        popen: The started process (a child of this one); its stdin is kept open for the
            child's lifetime.
    """

    def __init__(self, popen: Process) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(popen.pid)
        self._exited = asyncio.Event()
        self._watching = False
        #: The process that added the pidfd's reader (`unwatch`).
        self._watched_by = 0

    def _watch(self) -> None:
        """Start the one watch (pidfd reader, or a waiting thread) that sets ``_exited``."""
        if self._watching:
            return
        self._watching = True
        self._watched_by = os.getpid()
        loop = asyncio.get_running_loop()
        pidfd = self._pidfd
        if pidfd is not None:

            def on_exit() -> None:
                loop.remove_reader(pidfd)
                self.popen.wait()
                self._exited.set()

            loop.add_reader(pidfd, on_exit)
        else:

            def wait_in_thread() -> None:
                self.popen.wait()
                loop.call_soon_threadsafe(self._exited.set)

            threading.Thread(target=wait_in_thread, daemon=True).start()

    @classmethod
    def start(cls, spec: SpawnSpec) -> ChildProcess:
        """Start ``python -m runtime._child`` and hand it ``spec`` on stdin."""
        popen = subprocess.Popen(
            [sys.executable, "-m", "runtime._child"],
            stdin=subprocess.PIPE,
            close_fds=True,
            pass_fds=spec.how.inherit,
            # Its own process group: a terminal's Ctrl-C reaches the root only, which then
            # stops the tree in order (the children still die with their parent). Not its
            # own session: Linux gives each session its own scheduling group (autogroup),
            # which measurably slowed the first half second of every new actor's round
            # trips with the root.
            process_group=0,
            cwd=spec.cwd,
            env=child_env(),
        )
        assert popen.stdin is not None
        try:
            popen.stdin.write(spec_payload(spec))
            popen.stdin.flush()
        except BrokenPipeError:
            pass  # it died at once; wait() reports how
        return cls(popen)

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while running."""
        return self.popen.returncode

    async def wait(self) -> int:
        """Wait for the process to exit (seen from the process itself), reap it, and return
        its status. Any number of tasks may wait at once."""
        if self.popen.returncode is None:
            self._watch()
            await self._exited.wait()
        assert self.popen.returncode is not None
        return self.popen.returncode

    def signal(self, signum: int) -> None:
        """Send a signal unless the process was already reaped."""
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.signal(signal.SIGKILL)

    async def reap(self) -> int:
        """Wait for the exit, release, return the status; a cancellation meanwhile (anyio's
        or asyncio's) is raised once the process is reaped.

        A shielded scope held off anyio's cancellation only: asyncio's (``Task.cancel``,
        ``asyncio.timeout``) left the process unreaped and its pidfd open.
        """
        try:
            return await to_its_end(self.wait())
        finally:
            self.close()

    def close(self) -> None:
        """Release the pidfd and the stdin pipe (the child sees EOF if still alive)."""
        if self._pidfd is not None:
            if self._watching and self.popen.returncode is None:
                unwatch(asyncio.get_running_loop(), self._pidfd, self._watched_by)
            os.close(self._pidfd)
            self._pidfd = None
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()


def spec_payload(spec: SpawnSpec) -> bytes:
    """``spec`` as a child reads it on its stdin: length-prefixed msgpack."""
    payload = msgspec.msgpack.encode(spec)
    return _LENGTH.pack(len(payload)) + payload


async def start_process(
    spec: SpawnSpec,
    ready: asyncio.Future[Any],
    timeout: float,
    launch: Callable[[float], Awaitable[ChildProcess]] | None = None,
) -> tuple[ChildProcess, ReadyBody]:
    """Start an actor process and wait until it reports ready.

    Args:
        spec: What to start; ``spec.token`` correlates the report.
        ready: Resolved by the parent's reply inbox with the report (READY or FAILED).
        timeout: Seconds it has.
        launch: Starts the process given the seconds it may take, already handed its spec
            (a fork server's fork); default: a fresh interpreter (`ChildProcess.start`).

    Raises:
        SpawnError: It reported a failure, exited first, or was too slow (it is then
            killed); in every case the process has been reaped.
    """
    name = spec.target.name
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        proc = ChildProcess.start(spec) if launch is None else await launch(timeout)
    except BaseException:
        ready.cancel()
        raise
    exit_waiter = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait(
            {ready, exit_waiter},
            timeout=max(deadline - loop.time(), 0.0),
            return_when=asyncio.FIRST_COMPLETED,
        )
    except BaseException:
        # Cancelled while it starts: it must not live on unknown to anyone.
        ready.cancel()
        proc.kill()
        await proc.reap()
        raise
    finally:
        exit_waiter.cancel()
    if ready in done:
        try:
            header, body = ready.result()
        except RemoteActorError as err:
            await proc.reap()
            raise SpawnError(f"actor {name!r} failed to start: {err}") from err
        except BaseException:
            # No report will come (this system is closing): it must not outlive it.
            proc.kill()
            await proc.reap()
            raise
        assert isinstance(header, Header)
        assert header.kind is Kind.READY
        return proc, ready_decoder.decode(body)
    ready.cancel()
    if exit_waiter in done or proc.returncode is not None:
        code = await proc.reap()
        raise SpawnError(f"actor process {name!r} exited with status {code} before it was ready")
    proc.kill()
    await proc.reap()
    raise SpawnError(
        f"actor {name!r} did not become ready within {timeout:g} s; a slow on_start needs "
        "a larger spawn(spawn_timeout=...) or ActorSystem(spawn_timeout=...)"
    )


def child_env() -> dict[str, str]:
    """The environment of a new actor (or fork server) process: this one's, with the
    ``runtime`` package importable."""
    env = dict(os.environ)
    # The child imports `runtime` from wherever this process did.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
    return env


def read_spec(stream: typing.BinaryIO) -> SpawnSpec:
    """Read the length-prefixed spawn spec a parent wrote on stdin."""
    head = stream.read(_LENGTH.size)
    if len(head) != _LENGTH.size:
        raise SpawnError("no spawn spec on stdin: runtime._child is started by ActorSystem.spawn")
    (size,) = _LENGTH.unpack(head)
    return msgspec.msgpack.decode(stream.read(size), type=SpawnSpec)
