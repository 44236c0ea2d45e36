"""Placement on Ray: one tokenyard node on each Ray node, the ``ray`` extra
(``pip install 'tokenyard[ray]'``).

`RayPlacement` starts, for each Ray node it is given, a small Ray actor pinned to that
node (``NodeAffinitySchedulingStrategy(soft=False)``, no CPU, never restarted) whose only
work is to start ``python -m runtime node`` there and keep it. The node joins the root of
the system like any other (`runtime._nodes`); from then on ``system.spawn(..., node=name)``
and ``ChildSpec(node=...)`` talk to it directly over the system's CURVE tcp. Ray places
and watches; requests never travel through Ray, and no key does either: the keys
directory must be readable at the same path on every Ray node (a shared file system, or
provisioned with the hosts).

Who ends what:

- The node process runs in a session of its own (``start_new_session``), so Ray ending
  its actor's worker does not reach it by itself. The keeper asks the kernel to SIGKILL
  the node when the worker dies (``PR_SET_PDEATHSIG``, from the thread that forked it,
  which lives as long as the node does), and the node's actors die with the node (each
  asks the same of its parent). A worker SIGKILLed by ``ray.kill`` or by its Ray node
  going away thus takes its tokenyard node along at once, as a lost host would: the
  system's heartbeat makes that node's actors ``Down`` with `Cause.NOCONNECTION`, and
  supervisors move them (``ChildSpec(node=(a, b))``). ``--stdin-eof`` on a pipe only the
  worker holds is the second line: a node whose worker is gone stops on its own.
- Ray reports the keeper's death (the Ray actor died, its Ray node with it): the placement
  then drops the node from the root's table (`runtime._nodes.NodeTable.drop`) and from
  `RayPlacement.nodes`. Actor deaths stay the heartbeat's to decide.
- Leaving the placement stops each node (its standard input closed: it stops its actors
  gracefully; SIGTERM, then SIGKILL, to every process of its session after
  ``stop_timeout``) and kills the keepers.

Ray does not account for what tokenyard actors use: the keeper holds no resources, and
`RayPlacement.node_for_resources` only chooses a node whose Ray resources (its totals, as
``ray.nodes()`` reports them) cover a request.

Example:
    >>> async with ActorSystem(transport="tcp", tcp_host=ip, keys=keys) as system:
    ...     async with RayPlacement(system, keys) as placement:
    ...         gpu = placement.node_for_resources({"GPU": 1})
    ...         model = await system.spawn(Model, node=gpu)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ._errors import SpawnError, TokenyardError, to_its_end

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import TracebackType

    from ._system import ActorSystem

logger = logging.getLogger("tokenyard.ray")

_PR_SET_PDEATHSIG = 1
#: Hex digits of the Ray node id in a tokenyard node's name (more when two ids share them).
NAME_DIGITS = 8


@dataclass(frozen=True)
class RayNodeInfo:
    """One Ray node and the tokenyard node started on it.

    Attributes:
        name: The tokenyard node's name (``ray-`` and the start of the Ray node id): what
            ``system.spawn(..., node=name)`` takes.
        ray_node_id: The Ray node id (hex).
        ip: The Ray node's address (its "NodeManagerAddress" in ``ray.nodes()``), where
            the tokenyard node binds.
        resources: The Ray node's total resources (``CPU``, ``GPU``, ``memory``, custom ones).
        pid: The tokenyard node's process id on that host.
    """

    name: str
    ray_node_id: str
    ip: str
    resources: dict[str, float] = field(default_factory=dict)
    pid: int = 0


# -- the keeper: a Ray actor on each Ray node ---------------------------------------------


class NodeKeeper:
    """Starts one tokenyard node process on the Ray node it runs on, and keeps it.

    Runs as a threaded Ray actor (`RayPlacement` makes it one): `wait` blocks until the node
    process ends and is what the placement awaits; `stop` ends it meanwhile.

    Args:
        argv: The node's command line (``python -m runtime node ...`` without the
            interpreter, which is this worker's).
        env: Variables added to the worker's environment for the node.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self._argv = [sys.executable, *argv]
        self._env = dict(os.environ, **env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._exited = threading.Event()
        # The thread that forks the node must outlive it: the kernel's parent-death signal
        # follows the forking thread, not the process.
        threading.Thread(target=self._keep, name="tokenyard-node-keeper", daemon=True).start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _keep(self) -> None:
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            parent = os.getpid()

            def die_with_worker() -> None:  # between fork and exec: no locks, no imports
                prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != parent:
                    os._exit(1)

            self._proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.PIPE,
                env=self._env,
                start_new_session=True,
                preexec_fn=die_with_worker,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as err:  # creation fails
            self._error = err
            self._exited.set()
            return
        finally:
            self._started.set()
        self._proc.wait()
        self._exited.set()

    def pid(self) -> int:
        """The node process's id (also its session's and process group's)."""
        assert self._proc is not None
        return self._proc.pid

    def wait(self) -> int:
        """Block until the node process ends; its exit status."""
        self._exited.wait()
        assert self._proc is not None
        return self._proc.returncode

    def stop(self, timeout: float) -> int:
        """End the node: close its standard input (it stops its actors), then SIGTERM and
        SIGKILL after ``timeout`` each; then every process left in its session.

        Returns:
            The node's exit status.
        """
        proc = self._proc
        assert proc is not None
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._exited.wait(timeout):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        self._exited.wait()
        end_session(proc.pid, timeout)
        return proc.returncode


def session_members(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid`` (from /proc; zombies left out)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rpartition(b")")[2].split()
        except OSError:
            continue  # it ended during the scan
        if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            found.append(int(entry.name))
    return found


def end_session(sid: int, grace: float) -> None:
    """Let the processes of session ``sid`` end for ``grace`` seconds, then SIGKILL those
    left (an actor's parent-death signal and a guardian's cleanup take a moment)."""
    deadline = time.monotonic() + grace
    while (left := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)  # sync-ok: bounded poll of /proc, no event tells a session is empty
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- the placement --------------------------------------------------------------------------


def ray_nodes() -> list[dict[str, Any]]:
    """The alive Ray nodes, as ``ray.nodes()`` describes them."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n for n in nodes if n.get("Alive")]


def node_names(ray_node_ids: Sequence[str]) -> dict[str, str]:
    """Tokenyard node names for Ray node ids: ``ray-`` and the first `NAME_DIGITS` hex
    digits, more for ids that share them."""
    digits = NAME_DIGITS
    while len({i[:digits] for i in ray_node_ids}) < len(set(ray_node_ids)):
        digits += 4
    return {i: f"ray-{i[:digits]}" for i in ray_node_ids}


class RayPlacement:
    """Tokenyard nodes on Ray nodes, for an open root `runtime.ActorSystem`.

    An async context manager: entering starts a `NodeKeeper` Ray actor on each Ray node and
    returns once every tokenyard node has joined the system; leaving stops them all.

    Args:
        system: The system's root: open, over tcp with CURVE keys (its ``address`` is what
            the nodes join).
        keys: The system's keys directory, at the same path on every Ray node.
        ray_node_ids: The Ray nodes to start a node on (hex ids); ``None``: every alive one.
        heartbeat: The nodes' heartbeat in seconds; ``None``: the system's.
        env: Environment variables for the node processes (``PYTHONPATH`` so that the actor
            classes import there, for one).
        join_timeout: Seconds for the keepers to start and every node to join.
        stop_timeout: Seconds a stopping node has before SIGTERM, and again before SIGKILL.

    Raises:
        TokenyardError: (on entering) A keeper could not start its node, a node ended
            before it joined (at once, with its exit status), or a node did not join within
            ``join_timeout``; the nodes started are stopped first.

    The root's ``address`` must be reachable from every Ray node (its ``tcp_host`` an
    address of the network they share, not 127.0.0.1 unless they all run on one host), and
    actor classes must import on every node (``env={"PYTHONPATH": ...}``, or installed).
    Stop the actors that run on the placement's nodes before leaving it: leaving stops
    them with their nodes, gracefully, and a supervisor would restart them.

    Example:
        >>> async with RayPlacement(system, keys) as placement:
        ...     echo = await system.spawn(Echo, node=placement.node_for(ray_node_id))
    """

    def __init__(
        self,
        system: ActorSystem,
        keys: str | os.PathLike[str],
        ray_node_ids: Sequence[str] | None = None,
        *,
        heartbeat: float | None = None,
        env: Mapping[str, str] | None = None,
        join_timeout: float = 60.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.system = system
        self.keys = str(keys)
        self.ray_node_ids = list(ray_node_ids) if ray_node_ids is not None else None
        self.heartbeat = heartbeat if heartbeat is not None else system.options.heartbeat
        self.env = dict(env or {})
        self.join_timeout = join_timeout
        self.stop_timeout = stop_timeout
        #: The tokenyard nodes the placement keeps, by name (a Ray node's death removes it).
        self.nodes: dict[str, RayNodeInfo] = {}
        self._keepers: dict[str, Any] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._gone: dict[str, asyncio.Event] = {}
        #: Each keeper's `NodeKeeper.wait`, called once: it holds one of the keeper's
        #: threads until its node ends (awaited by the join, then by the watch).
        self._ends: dict[str, Any] = {}
        self._actor_class: Any = ray.remote(NodeKeeper)

    # -- choosing a node --------------------------------------------------------------------

    def node_for(self, ray_node_id: str) -> str:
        """The tokenyard node on Ray node ``ray_node_id`` (its name, for ``node=``).

        Raises:
            SpawnError: The placement has no node there (not given, or its Ray node died).
        """
        for info in self.nodes.values():
            if info.ray_node_id == ray_node_id:
                return info.name
        raise SpawnError(f"the placement has no node on Ray node {ray_node_id}")

    def node_for_resources(self, request: Mapping[str, float]) -> str:
        """A tokenyard node whose Ray node has at least ``request`` of each resource
        (``{"GPU": 1}``, custom ones), the first in the placement's order.

        Raises:
            SpawnError: No node of the placement has them.
        """
        for info in self.nodes.values():
            if all(info.resources.get(key, 0.0) >= want for key, want in request.items()):
                return info.name
        raise SpawnError(f"no node of the placement has the resources {dict(request)}")

    # -- starting and stopping --------------------------------------------------------------

    async def __aenter__(self) -> RayPlacement:
        if self.system.node_table is None:
            raise TokenyardError("a RayPlacement needs the root of a tcp system with keys")
        alive = {n["NodeID"]: n for n in ray_nodes()}
        ids = self.ray_node_ids if self.ray_node_ids is not None else list(alive)
        missing = [i for i in ids if i not in alive]
        if missing:
            raise TokenyardError(f"Ray nodes {missing} are not alive in the cluster")
        names = node_names(ids)
        try:
            with anyio.fail_after(self.join_timeout):
                await self._start(ids, names, alive)
            await self._joined(list(names.values()))
        except BaseException as err:
            await self._stop_to_the_end()
            if isinstance(err, TimeoutError):
                raise TokenyardError(
                    f"the Ray placement's nodes did not start and join: {err}"
                ) from err
            raise
        for name in names.values():
            self._gone[name] = asyncio.Event()
            self._watchers[name] = asyncio.get_running_loop().create_task(self._watch(name))
        return self

    async def _start(
        self, ids: Sequence[str], names: Mapping[str, str], alive: Mapping[str, Any]
    ) -> None:
        for ray_node_id in ids:
            name, ip = names[ray_node_id], alive[ray_node_id]["NodeManagerAddress"]
            argv = [
                "-m", "runtime", "node", "--system", self.system.address, "--keys", self.keys,
                "--name", name, "--host", ip, "--heartbeat", str(self.heartbeat),
                "--stdin-eof",
            ]  # fmt: skip
            self._keepers[name] = self._actor_class.options(
                name=f"tokenyard-{name}-{os.getpid()}",
                num_cpus=0,
                max_restarts=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            ).remote(argv, self.env)
            self.nodes[name] = RayNodeInfo(
                name, ray_node_id, ip, dict(alive[ray_node_id].get("Resources", {}))
            )
        for name, keeper in self._keepers.items():
            try:
                pid = await keeper.pid.remote()
            except ray.exceptions.RayError as err:
                raise TokenyardError(f"Ray could not start node {name}: {err}") from err
            info = self.nodes[name]
            self.nodes[name] = dataclasses.replace(info, pid=pid)

    async def _joined(self, names: list[str]) -> None:
        """Wait until every node has joined the system, failing as soon as one ends first
        (a bad ``keys`` path, say: it exits at once, and `join_timeout` need not pass).
        Plain tasks, not a task group: its errors would come wrapped in an ExceptionGroup."""
        joined = asyncio.ensure_future(self.system.wait_nodes(names, self.join_timeout))
        for name in names:
            self._ends[name] = self._keepers[name].wait.remote()
        ends = {asyncio.ensure_future(self._ends[n]): n for n in names}
        try:
            done, _ = await asyncio.wait([joined, *ends], return_when=asyncio.FIRST_COMPLETED)
            if joined in done:
                joined.result()  # TimeoutError: one never joined
                return
            ended = next(iter(done))
            name = ends[ended]
            try:
                why = f"exited with status {ended.result()}"
            except ray.exceptions.RayError as err:
                why = f"was lost (Ray reports its keeper dead: {err})"
            raise TokenyardError(
                f"tokenyard node {name} {why} before it joined (its own log, in the Ray "
                "worker's, says why)"
            )
        finally:
            for task in (joined, *ends):
                task.cancel()

    async def _watch(self, name: str) -> None:
        """Await the keeper's `NodeKeeper.wait`: it returns when the node ends, and fails
        when Ray reports the keeper dead (with its Ray node, or killed)."""
        keeper = self._keepers[name]
        try:
            status = await self._ends.pop(name)
            logger.warning("tokenyard node %s on Ray ended (exit status %s)", name, status)
            ray.kill(keeper, no_restart=True)  # a keeper without a node has done its work
        except ray.exceptions.RayError as err:
            logger.warning("tokenyard node %s: Ray reports its keeper dead: %s", name, err)
        self._forget(name)

    async def wait_gone(self, name: str, timeout: float) -> None:
        """Return once node ``name`` has left the placement: its process ended, or Ray
        reported its keeper dead (its Ray node lost, or the keeper killed), and the root's
        table no longer holds it.

        Raises:
            TimeoutError: It was still there after ``timeout`` seconds.
            SpawnError: The placement never had a node of that name.
        """
        gone = self._gone.get(name)
        if gone is None:
            raise SpawnError(f"the placement has no node named {name!r}")
        try:
            with anyio.fail_after(timeout):
                await gone.wait()
        except TimeoutError:
            raise TimeoutError(f"node {name} was still placed after {timeout:g} s") from None

    def _forget(self, name: str) -> None:
        if name in self._gone:
            self._gone[name].set()
        self.nodes.pop(name, None)
        self._keepers.pop(name, None)
        self._ends.pop(name, None)
        self._watchers.pop(name, None)
        if self.system.node_table is not None:
            self.system.node_table.drop(name)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop_to_the_end()

    async def _stop_to_the_end(self) -> None:
        """`_stop_all`, to its end however the caller is cancelled meanwhile (its
        cancellation is raised after). A shielded scope holds off anyio's cancellation only:
        asyncio's (``Task.cancel``, ``asyncio.timeout``) left nodes running, their keepers
        alive, and the nodes still listed."""
        await to_its_end(self._stop_all())

    async def _stop_all(self) -> None:
        watchers = list(self._watchers.values())
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        keepers = dict(self._keepers)

        async def stop(name: str, keeper: Any) -> None:
            try:
                with anyio.fail_after(3 * self.stop_timeout + 5):
                    await keeper.stop.remote(self.stop_timeout)
            except (ray.exceptions.RayError, TimeoutError) as err:
                logger.warning("tokenyard node %s did not stop through Ray: %s", name, err)
            ray.kill(keeper, no_restart=True)  # its worker's death ends the node if it lives

        async with anyio.create_task_group() as tg:
            for name, keeper in keepers.items():
                tg.start_soon(stop, name, keeper)
        for name in keepers:
            self._forget(name)
