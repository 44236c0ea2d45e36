"""Placement on Ray (`runtime.ray`): Ray's local multi-node cluster on this machine, a
tokenyard node on each Ray node, an actor placed on a chosen one, the loss of that Ray
node and the actor's move to the other; ending the placement ends the node processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import pytest


class ProcessGlobals:
    """What importing Ray (a log record factory, an excepthook, warning filters) and
    ``ray.init`` (signal handlers, warning filters) change in this process: saved, and put
    back for the rest of the suite."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE)

    def __init__(self) -> None:
        self.record_factory = logging.getLogRecordFactory()
        self.excepthook = sys.excepthook
        self.filters = list(warnings.filters)
        self.handlers = {sig: signal.getsignal(sig) for sig in self.SIGNALS}

    def restore(self) -> None:
        logging.setLogRecordFactory(self.record_factory)
        sys.excepthook = self.excepthook
        cast("list[Any]", warnings.filters)[:] = self.filters
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)


_before_ray = ProcessGlobals()
import ray as ray_module  # noqa: E402
import ray.cluster_utils as cluster_utils  # noqa: E402

from runtime import ActorSystem, Cause, ChildSpec, Supervisor, TokenyardError  # noqa: E402
from runtime.ray import RayPlacement, session_members  # noqa: E402
from tests.conftest import child_pids  # noqa: E402
from tests.integration._actors import (  # noqa: E402
    Echo,
    GetPid,
    Journal,
    Ping,
    Pong,
    Recorder,
    ReportsItsStop,
    Worker,
)
from tests.multihost._support import replacement, running  # noqa: E402

_before_ray.restore()
#: Ray's API, untyped (its functions carry no annotations).
ray: Any = ray_module

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
#: Heartbeat of these systems: a lost node is known within it.
HEARTBEAT = 1.0
LOSS_SEEN_WITHIN = 2 * HEARTBEAT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    # Ray's own modules warn (deprecations) on import and while connecting.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


class RayCluster:
    """A Ray head node (1 CPU) in this process's care, and side nodes added and removed."""

    def __init__(self) -> None:
        self.cluster: Any = cluster_utils.Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.head_id: str = ray.get_runtime_context().get_node_id()
        self.ip: str = ray.util.get_node_ip_address()

    def add_side(self) -> tuple[Any, str]:
        """A second Ray node (1 CPU, resource ``side``), once Ray counts it alive; its id.

        (Not ``Cluster.wait_for_nodes``: it also waits for a node removed earlier to be
        marked dead, which takes Ray's health check some ten seconds.)"""
        node = self.cluster.add_node(num_cpus=1, resources={"side": 1})
        side_id: str = node.node_id
        deadline = time.monotonic() + 30
        while not any(n["NodeID"] == side_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "Ray did not count the new node alive"
            time.sleep(0.1)  # sync-ok: bounded poll of Ray's node table, no event for it
        return node, side_id

    def remove(self, node: Any) -> None:
        """The Ray node's processes killed and reaped (Ray's ``remove_node``)."""
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """One head node for the module (its start is most of the cost); each test adds and
    removes its own side node, which the leak guard checks. The head's processes are this
    process's children: they are checked here, once the cluster is shut down."""
    before, globals_before = child_pids(), ProcessGlobals()
    started = time.monotonic()
    cluster = RayCluster()
    print(f"Ray head node started and connected in {time.monotonic() - started:.2f} s")
    try:
        yield cluster
    finally:
        cluster.shutdown()
        globals_before.restore()
        left = _reaped_within(before, 30.0)
        assert not left, f"Ray's processes left behind: {sorted(left)}"


def _reaped_within(before: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := child_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)  # sync-ok: Ray's shutdown reaps its daemons itself, with no event
    return left


async def gone(pids: list[int], timeout: float) -> list[int]:
    """The pids among ``pids`` still running after at most ``timeout`` seconds (waited for
    on their pidfds: they are not this process's children)."""
    with anyio.move_on_after(timeout):
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                await anyio.wait_readable(fd)  # readable once the process has exited
            finally:
                os.close(fd)
    return [p for p in pids if running(p)]


def root_system(cluster: RayCluster, tmp_path: Path) -> ActorSystem:
    return ActorSystem(
        name="root", transport="tcp", tcp_host=cluster.ip, keys=tmp_path / "keys",
        heartbeat=HEARTBEAT,
    )  # fmt: skip


def placement(system: ActorSystem, tmp_path: Path, ids: list[str]) -> RayPlacement:
    return RayPlacement(
        system, tmp_path / "keys", ids, env={"PYTHONPATH": str(ROOT)}, join_timeout=60
    )


class TestRayPlacement:
    async def test_an_actor_on_a_chosen_ray_node_survives_its_removal(
        self, ray_cluster: RayCluster, tmp_path: Path
    ) -> None:
        side, side_id = ray_cluster.add_side()
        try:
            async with (
                root_system(ray_cluster, tmp_path) as system,
                placement(system, tmp_path, [ray_cluster.head_id, side_id]) as places,
            ):
                side_node = places.node_for(side_id)
                head_node = places.node_for(ray_cluster.head_id)
                assert places.node_for_resources({"side": 1}) == side_node
                assert sorted(n.name for n in await system.nodes()) == sorted(
                    [side_node, head_node]
                )
                echo = await system.spawn(Echo, 3, node=side_node, name="echo")
                assert system.node_of(echo) == side_node
                assert await echo.ask(Ping(n=2)) == Pong(n=6)
                await system.stop(echo)

                sup = await system.spawn(
                    Supervisor,
                    children=[ChildSpec(Worker, name="w", node=(side_node, head_node))],
                    name="sup",
                )
                first = await system.lookup("w")
                first_pid = (await first.ask(GetPid())).pid
                side_pids = session_members(places.nodes[side_node].pid)
                assert first_pid in side_pids
                watch = system.watch(first)

                removing = time.monotonic()
                ray_cluster.remove(side)  # its raylet killed: the keeper's worker exits
                side = None
                removed = time.monotonic()
                with anyio.fail_after(10):
                    down = await watch
                seen = time.monotonic() - removed
                assert down.cause is Cause.NOCONNECTION, down
                assert seen < LOSS_SEEN_WITHIN, seen
                second = await replacement(sup, first)
                assert (await second.ask(GetPid())).pid != first_pid
                assert await gone(side_pids, 10.0) == []
                reported = time.monotonic()
                await places.wait_gone(side_node, 30)  # Ray's report of the death
                reported = time.monotonic() - reported
                assert [n.name for n in await system.nodes()] == [head_node]
                # Its actors are stopped before their nodes are (a supervisor would
                # restart a child its node stopped).
                await system.stop(sup)
                print(
                    f"remove_node {removed - removing:.2f} s, then Down in {seen:.2f} s;"
                    f" Ray's report {reported:.2f} s after the restart"
                )
        finally:
            if side is not None:
                ray_cluster.remove(side)

    async def test_a_node_that_ends_before_it_joins_fails_the_placement_at_once(
        self, ray_cluster: RayCluster, tmp_path: Path
    ) -> None:
        """A node that cannot start (here, ``keys`` names a directory without the system's
        key) exits at once: before, the placement waited out its whole join_timeout, and
        said only that the node did not join."""
        elsewhere = tmp_path / "no-keys-here"
        elsewhere.mkdir()
        async with root_system(ray_cluster, tmp_path) as system:
            places = RayPlacement(
                system, elsewhere, [ray_cluster.head_id], env={"PYTHONPATH": str(ROOT)},
                join_timeout=60,
            )  # fmt: skip
            with pytest.raises(TokenyardError, match="exited with status 2 before it joined"):
                async with places:
                    pytest.fail("a node without keys joined")
            assert places.nodes == {}

    async def test_a_killed_keeper_ends_its_node_and_leaving_ends_the_rest(
        self, ray_cluster: RayCluster, tmp_path: Path
    ) -> None:
        side, side_id = ray_cluster.add_side()
        try:
            async with root_system(ray_cluster, tmp_path) as system:
                started = time.monotonic()
                async with placement(system, tmp_path, [ray_cluster.head_id, side_id]) as places:
                    joined = time.monotonic() - started
                    side_node = places.node_for(side_id)
                    head_node = places.node_for(ray_cluster.head_id)
                    echo = await system.spawn(Echo, 2, node=side_node)
                    assert await echo.ask(Ping(n=4)) == Pong(n=8)
                    here = await system.spawn(Echo, 3, node=head_node)
                    side_pids = session_members(places.nodes[side_node].pid)
                    head_pids = session_members(places.nodes[head_node].pid)
                    assert len(side_pids) >= 2  # the node and its actor at least
                    assert len(head_pids) >= 2
                    watch = system.watch(echo)
                    # Ray kills the keeper's worker outright (SIGKILL): nothing of the
                    # worker runs, the kernel takes its node along.
                    ray.kill(ray.get_actor(f"tokenyard-{side_node}-{os.getpid()}"))
                    with anyio.fail_after(10):
                        down = await watch
                    assert down.cause is Cause.NOCONNECTION, down
                    assert await gone(side_pids, 10.0) == []
                    await places.wait_gone(side_node, 30)  # Ray's report of the death
                    assert [n.name for n in await system.nodes()] == [head_node]
                    assert await here.ask(Ping(n=1)) == Pong(n=3)
                    await system.stop(here)
                assert await gone(head_pids, 10.0) == []
                assert places.nodes == {}
                assert await system.nodes() == []
                print(f"placement joined in {joined:.2f} s")
        finally:
            ray_cluster.remove(side)


class TestCancelledByAsyncio:
    async def test_a_placement_cancelled_while_it_leaves_still_ends_every_node(
        self, ray_cluster: RayCluster, tmp_path: Path
    ) -> None:
        """asyncio's own cancellation (``Task.cancel``, an ``asyncio.timeout`` around the
        placement) passes anyio's shielded scopes: a placement cancelled while it stopped
        its nodes cancelled their stops, never killed their keepers, and went on as if not
        cancelled."""
        journal = Journal()
        async with root_system(ray_cluster, tmp_path) as system:
            recorder = await system.spawn(Recorder, journal, process=False)
            places = RayPlacement(
                system, tmp_path / "keys", [ray_cluster.head_id], env={"PYTHONPATH": str(ROOT)},
                join_timeout=60, stop_timeout=1,
            )  # fmt: skip
            joined, leave = asyncio.Event(), asyncio.Event()
            pids: list[int] = []

            async def use_it() -> None:
                async with places:
                    node = places.node_for(ray_cluster.head_id)
                    await system.spawn(ReportsItsStop, recorder, node=node, name="holds")
                    pids.extend(session_members(places.nodes[node].pid))
                    joined.set()
                    await leave.wait()

            task = asyncio.ensure_future(use_it())
            with anyio.fail_after(60):
                await joined.wait()
            leave.set()
            with anyio.fail_after(30):
                await journal.wait_for(1)  # its node is stopping its actor
            task.cancel()  # as an asyncio.timeout around it does
            with anyio.fail_after(60), pytest.raises(asyncio.CancelledError):
                await task
            assert places.nodes == {}
            assert await system.nodes() == []
            assert len(pids) >= 2  # the node and its actor at least
            assert await gone(pids, 10.0) == []


async def test_a_node_whose_standard_input_ends_stops_with_its_actors(tmp_path: Path) -> None:
    """The keeper's second line: ``--stdin-eof`` on a pipe whose writer goes away (here
    closed by hand; a dead worker's is closed by the kernel)."""
    async with ActorSystem(
        name="root", transport="tcp", keys=tmp_path / "keys", heartbeat=HEARTBEAT
    ) as system:
        proc = await anyio.open_process(
            [
                sys.executable, "-m", "runtime", "node", "--system", system.address,
                "--keys", str(tmp_path / "keys"), "--name", "n", "--host", "127.0.0.1",
                "--heartbeat", str(HEARTBEAT), "--stdin-eof",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=None,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        try:
            await system.wait_nodes(["n"], 30)
            echo = await system.spawn(Echo, 2, node="n")
            actor_pid = system.pid_of(echo)
            assert actor_pid is not None
            watch = system.watch(echo)
            assert proc.stdin is not None
            await proc.stdin.aclose()
            with anyio.fail_after(20):
                down = await watch
                code = await proc.wait()
            assert down.cause is Cause.NORMAL, down
            assert code == 0
            assert await gone([actor_pid], 10.0) == []
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_importing_runtime_does_not_import_ray() -> None:
    code = "import sys, runtime; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    assert os.path.exists(ROOT / "runtime" / "ray.py")
