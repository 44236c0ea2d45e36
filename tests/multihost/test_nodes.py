"""Actors on another host: a node in a second network namespace, real tcp over a veth pair,
CURVE with the system's keys; kills, a killed node, a cut link and its return."""

from __future__ import annotations

import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import pytest

from runtime import (
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Cause,
    ChildSpec,
    RemoteActorError,
    SpawnError,
    Supervisor,
)
from runtime._auth import Keys
from runtime._protocol import Kind, NodeHello, body_encoder, nodes_decoder
from tests.conftest import exits_within
from tests.integration._actors import (
    Collector,
    Echo,
    FailsOnHost,
    Forward,
    Gathered,
    GetCount,
    GetPid,
    Ping,
    Pong,
    Slow,
    StartsSlowly,
    Stubborn,
    TellTo,
    Tick,
    Worker,
)
from tests.multihost._support import replacement, running

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .conftest import Hosts, NodeProcess

#: Heartbeat of these systems: a lost node is known within it.
HEARTBEAT = 1.0
#: What the tests allow for that on a loaded two-core machine (the bound itself is
#: measured by ``python -m benchmarks multihost``).
LOSS_SEEN_WITHIN = 2 * HEARTBEAT

pytestmark = pytest.mark.timeout(90)


@asynccontextmanager
async def two_hosts(
    hosts: Hosts,
    tmp_path: Path,
    node_heartbeat: float = HEARTBEAT,
    heartbeat: float = HEARTBEAT,
    **options: Any,
) -> AsyncIterator[tuple[ActorSystem, NodeProcess]]:
    """A root on host A (its heartbeat ``heartbeat``) and node "b" on host B (whose own
    heartbeat is ``node_heartbeat``), joined."""
    keys = tmp_path / "keys"
    node: NodeProcess | None = None
    try:
        async with ActorSystem(
            name="root", transport="tcp", tcp_host=hosts.a, keys=keys, heartbeat=heartbeat,
            **options,
        ) as system:  # fmt: skip
            node = await hosts.start_node(
                system.address, keys, "b", "--heartbeat", str(node_heartbeat)
            )
            yield system, node
    finally:
        if node is not None:
            node.stop()


def first_line_with(stream: IO[str] | None, text: str) -> str:
    """The first line of ``stream`` holding ``text`` (``""``: it ended without one)."""
    assert stream is not None
    return next((line for line in stream if text in line), "")


def on_host(ref: ActorRef[Any], host: str) -> bool:
    return ref.address.startswith(f"tcp://{host}:")


async def pid_of(ref: ActorRef[Any]) -> int:
    reply = await ref.ask(GetPid())
    return int(reply.pid)


async def worker_on_b_or_here(
    system: ActorSystem, hosts: Hosts
) -> tuple[ActorRef[Any], ActorRef[Any], int]:
    """A supervisor here whose worker may run on b or here: it starts on b. The supervisor,
    the worker and the worker's pid."""
    sup = await system.spawn(
        Supervisor, children=[ChildSpec(Worker, name="w", node=("b", ""))], name="sup"
    )
    first = await system.lookup("w")
    assert on_host(first, hosts.b)
    return sup, first, await pid_of(first)


class TestAnActorOnAnotherHost:
    async def test_it_answers_and_talks_back_with_refs_in_messages(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _station):
            assert [n.name for n in await system.nodes()] == ["b"]
            echo = await system.spawn(Echo, 3, node="b", name="echo")
            assert on_host(echo, hosts.b)
            assert system.node_of(echo) == "b"
            assert await echo.ask(Ping(n=2)) == Pong(n=6)
            # B tells A: a ref to an actor in this process, inside a message.
            gathered = Gathered()
            collector = await system.spawn(Collector, gathered, process=False)
            await echo.tell(TellTo(target=collector, n=5))
            with anyio.fail_after(10):
                await gathered.wait_for(n_pings=1)
            assert gathered.pings == [5]
            # B asks an actor process on A from inside a handler.
            here = await system.spawn(Echo, 10, name="here")
            assert on_host(here, hosts.a)
            assert await echo.ask(Forward(target=here, n=2)) == Pong(n=20)
            for n in range(200):
                await echo.tell(Tick(n=n))
            count = await echo.ask(GetCount())
            assert count.n == 200
            assert await system.lookup("echo") == echo
            down = await system.stop(echo)
            assert down.normal
            stuck = await system.spawn(Echo, node="b", name="stuck")
            killed = await system.kill(stuck, "stuck in a handler")
            assert (killed.cause, killed.reason) == (Cause.UNRESPONSIVE, "stuck in a handler")

    async def test_one_that_outlasts_its_stop_and_sigterm_is_killed_and_its_stop_returns(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # The stop's bounded waits for its death share the one future its node's word
        # resolves: the first wait that timed out cancelled it, and the stop raised a
        # CancelledError of nobody's once SIGKILL had been sent.
        async with two_hosts(hosts, tmp_path) as (system, _station):
            ref = await system.spawn(Stubborn, True, node="b", shutdown_timeout=0.5)
            with anyio.fail_after(30):
                down = await system.stop(ref)
            assert down.signal == signal.SIGKILL, down
            assert await system.lookup(ref.name, missing_ok=True) is None

    async def test_a_remote_supervisor_answers_lookups_for_its_children(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _station):
            await system.spawn(
                Supervisor, children=[ChildSpec(Worker, name="leaf")], name="sup", node="b"
            )
            leaf = await system.lookup("leaf")
            assert on_host(leaf, hosts.b)
            assert await pid_of(leaf) > 0

    async def test_a_spawn_on_an_unknown_node_fails_clearly(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _station):
            with pytest.raises(SpawnError, match="no node named 'nowhere'"):
                await system.spawn(Echo, node="nowhere")

    async def test_a_node_raises_its_open_file_limit_to_the_hard_one(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert hard > 512, f"the hard RLIMIT_NOFILE is {hard}: nothing to raise"
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # what the node inherits
        try:
            async with two_hosts(hosts, tmp_path) as (_system, node):
                limits = Path(f"/proc/{node.pid}/limits").read_text()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
        assert line.split()[3:5] == [str(hard), str(hard)]

    async def test_a_remote_start_that_fails_is_a_spawn_error_and_a_child_moves_on(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _node):
            with pytest.raises(SpawnError, match=f"not on {hosts.b}"):
                await system.spawn(FailsOnHost, hosts.b, node="b", name="fails")
            # A child placed on b, then here, starts here: its supervisor moves on from a
            # SpawnError only.
            await system.spawn(
                Supervisor,
                children=[ChildSpec(FailsOnHost, args=(hosts.b,), name="w", node=("b", ""))],
                name="sup",
            )
            child = await system.lookup("w")
            assert on_host(child, hosts.a)
            assert await child.ask(Ping(n=3)) == Pong(n=3)

    async def test_a_remote_spawn_given_up_leaves_no_actor_on_the_node(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _node):
            gathered = Gathered()
            collector = await system.spawn(Collector, gathered, process=False)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: system.spawn(StartsSlowly, collector, 2.0, node="b", name="slow")
                )
                with anyio.fail_after(30):
                    await gathered.wait_for(n_counts=1)
                tg.cancel_scope.cancel()  # the caller gives up while its on_start runs
            pid = gathered.counts[0].n
            # Its answer comes once on_start ends, to a spawn given up: the actor is killed,
            # not kept alive for ever by this process's heartbeat with the node.
            # (In a thread: the root's loop answers the node's heartbeat meanwhile.)
            gone = await anyio.to_thread.run_sync(exits_within, pid, 2.0 + 4 * HEARTBEAT)
            assert gone, "the actor outlived its spawn"

    async def test_a_spawn_on_a_node_lost_meanwhile_fails_within_the_heartbeats_bound(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _node):
            gathered = Gathered()
            collector = await system.spawn(Collector, gathered, process=False)
            failed: list[BaseException] = []
            ended = anyio.Event()

            async def spawn() -> None:
                try:
                    await system.spawn(StartsSlowly, collector, 60.0, node="b", name="slow")
                except SpawnError as err:
                    failed.append(err)
                ended.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(spawn)
                with anyio.fail_after(30):
                    await gathered.wait_for(n_counts=1)  # its on_start runs on the node
                cut = time.monotonic()
                hosts.cut()
                try:
                    # Not the spawn's whole timeout (30 s, and a heartbeat).
                    with anyio.fail_after(10):
                        await ended.wait()
                finally:
                    hosts.restore()
            assert time.monotonic() - cut <= 2 * LOSS_SEEN_WITHIN
            assert "was lost" in str(failed[0])


class TestDeathAcrossHosts:
    async def test_a_killed_remote_actor_is_down_with_its_signal_and_restarted_there(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _station):
            sup = await system.spawn(
                Supervisor, children=[ChildSpec(Worker, name="w", node="b")], name="sup"
            )
            first = await system.lookup("w")
            assert on_host(first, hosts.b)
            watch = system.watch(first)
            os.kill(await pid_of(first), signal.SIGKILL)
            with anyio.fail_after(10):
                down = await watch
            assert (down.cause, down.signal) == (Cause.SIGNAL, signal.SIGKILL)
            second = await replacement(sup, first)
            assert on_host(second, hosts.b)
            assert second.incarnation == first.incarnation + 1
            assert await pid_of(second) > 0

    async def test_the_name_of_a_remote_actor_is_free_once_its_death_is_known(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, _station):
            first = await system.spawn(Worker, name="w", node="b")
            with pytest.raises(SpawnError, match="'w': incarnation 1 of it is alive"):
                await system.spawn(Worker, name="w", node="b")
            watch = system.watch(first)
            os.kill(await pid_of(first), signal.SIGKILL)
            with anyio.fail_after(10):
                await watch
            # Whoever heard of the death may start the name again at once, as a supervisor
            # does, though this process records it only after its watchers heard.
            second = await system.spawn(Worker, name="w", node="b")
            assert second.incarnation == 2
            assert await pid_of(second) > 0

    async def test_a_killed_node_is_noconnection_within_the_bound_and_its_actor_moves(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, node):
            sup, first, first_pid = await worker_on_b_or_here(system, hosts)
            watch = system.watch(first)
            failed: list[BaseException] = []

            async def ask_slowly() -> None:
                try:
                    await first.ask(Slow(seconds=60), timeout=60)
                except ActorDeadError as err:
                    failed.append(err)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_slowly)
                await anyio.wait_all_tasks_blocked()
                killed = time.monotonic()
                node.kill()
                with anyio.fail_after(10):
                    down = await watch
                seen = time.monotonic() - killed
            assert down.cause is Cause.NOCONNECTION, down
            assert seen <= LOSS_SEEN_WITHIN, seen
            assert len(failed) == 1
            second = await replacement(sup, first)
            assert on_host(second, hosts.a)
            assert await second.ask(GetPid()) is not None
            assert not running(first_pid)

    async def test_a_cut_link_ends_the_remote_incarnation_and_its_return_serves_no_duplicate(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, node):
            sup, first, first_pid = await worker_on_b_or_here(system, hosts)
            watch = system.watch(first)
            cut = time.monotonic()
            hosts.cut()
            try:
                with anyio.fail_after(10):
                    down = await watch
                seen = time.monotonic() - cut
                # The node ended it for the silence before this side counted it lost.
                assert not running(first_pid)
            finally:
                hosts.restore()
            assert down.cause is Cause.NOCONNECTION, down
            assert seen <= LOSS_SEEN_WITHIN, seen
            second = await replacement(sup, first)
            assert on_host(second, hosts.a)
            # The link is back: the node joins again, and only the new incarnation serves.
            await anyio.to_thread.run_sync(node.wait_joined, 30.0)
            assert [n.name for n in await system.nodes()] == ["b"]
            assert await system.lookup("w") == second
            with pytest.raises(ActorDeadError):
                await first.ask(GetPid(), timeout=5)
            again = await system.spawn(Echo, 2, node="b", name="again")
            assert await again.ask(Ping(n=4)) == Pong(n=8)

    async def test_a_node_whose_heartbeat_is_longer_still_ends_the_actor_first(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # The node checks its leases often enough for the root's heartbeat (1 s), not for
        # its own (200 s: a twentieth of it is 10 s, when the root counts the worker lost
        # within 2).
        async with two_hosts(hosts, tmp_path, node_heartbeat=200.0) as (system, _node):
            worker = await system.spawn(Worker, node="b", name="w")  # the root its requester
            pid = await pid_of(worker)
            watch = system.watch(worker)
            hosts.cut()
            try:
                with anyio.fail_after(10):
                    down = await watch
                assert not running(pid), "the root counts it dead while it still runs"
            finally:
                hosts.restore()
            assert down.cause is Cause.NOCONNECTION, down

    async def test_a_node_stopped_past_the_lease_ends_its_actors_when_it_resumes(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # A stopped node stops its watchdog too (a known gap), but once it resumes the
        # lease has run out and its actors end at once. Before, when its loop read the
        # pings queued during the stop before the watchdog looked, they renewed the lease,
        # and the pings of the root it then joined again kept renewing it: the incarnation
        # the root counted lost ran on for good (a race at the resume: five rounds).
        async with two_hosts(hosts, tmp_path) as (system, node):
            for i in range(5):
                worker = await system.spawn(Worker, node="b", name=f"w{i}")
                pid = await pid_of(worker)
                watch = system.watch(worker)
                os.kill(node.pid, signal.SIGSTOP)
                try:
                    with anyio.fail_after(10):
                        down = await watch
                finally:
                    os.kill(node.pid, signal.SIGCONT)
                assert down.cause is Cause.NOCONNECTION, down
                ended = await anyio.to_thread.run_sync(exits_within, pid, 2 * HEARTBEAT)
                assert ended, f"round {i}: the lost incarnation runs on after the resume"
                await anyio.to_thread.run_sync(node.wait_joined, 10.0)  # back for the next

    async def test_a_node_restarted_on_its_port_within_the_heartbeat_ends_the_old_ones(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # A node SIGKILLed and started again on the same --port before the root's
        # heartbeat ran out: the new process answered the pings sent to the old one's
        # address, so the old one's actors were never Down (a supervisor kept a dead child
        # for good). Its answers say it is another process: the old one is lost at once.
        # A heartbeat of 8 s: a restart slowed by a loaded machine is still within it.
        keys = tmp_path / "keys"
        nodes: list[NodeProcess] = []
        try:
            async with ActorSystem(
                name="root", transport="tcp", tcp_host=hosts.a, keys=keys, heartbeat=8.0
            ) as system:
                port = str(hosts.free_port())
                nodes.append(await hosts.start_node(system.address, keys, "b", "--port", port))
                worker = await system.spawn(Worker, node="b", name="w")
                watch = system.watch(worker)
                heartbeat = system.station.heartbeat
                address = (await system.nodes())[0].address
                for _ in range(1000):  # 10 s: until the old node has answered a ping
                    if heartbeat.answered_as(address):
                        break
                    await anyio.sleep(0.01)  # sync-ok: polling what the heartbeat heard
                nodes[0].kill()
                nodes.append(await hosts.start_node(system.address, keys, "b", "--port", port))
                with anyio.fail_after(10):
                    down = await watch
                assert down.cause is Cause.NOCONNECTION, down
                assert "answers as another process" in down.reason, down
                await anyio.to_thread.run_sync(nodes[1].wait_joined, 20.0)  # dropped, back
                again = await system.spawn(Echo, 2, node="b", name="again")
                assert await again.ask(Ping(n=4)) == Pong(n=8)
        finally:
            for node in nodes:
                node.stop()

    async def test_a_node_whose_heartbeat_is_longer_joins_again_soon_after_a_cut(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # The root (1 s) drops the node during the cut; the node notices that the root's
        # pings stopped within the root's heartbeat, not its own (60 s: before, it stayed
        # out of the table for that long after the link came back).
        async with two_hosts(hosts, tmp_path, node_heartbeat=60.0) as (system, node):
            first = await system.spawn(Echo, 1, node="b", name="first")
            watch = system.watch(first)
            hosts.cut()
            try:
                with anyio.fail_after(10):
                    await watch  # the root counted the node lost, and dropped it
            finally:
                hosts.restore()
            assert await system.nodes() == []
            await anyio.to_thread.run_sync(node.wait_joined, 10.0)
            again = await system.spawn(Echo, 2, node="b", name="again")
            assert await again.ask(Ping(n=4)) == Pong(n=8)

    async def test_a_node_whose_heartbeat_is_shorter_joins_once(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        # The root (16 s) pings every 2 s: judged by the node's own heartbeat (1 s), it
        # seemed lost between two pings, and the node joined again every 2 s, saying so.
        async with two_hosts(hosts, tmp_path, heartbeat=16.0) as (system, node):
            joined_again = await anyio.to_thread.run_sync(says_a_line_within, node, 3.0)
            assert not joined_again, joined_again
            assert [n.name for n in await system.nodes()] == ["b"]

    async def test_connections_from_a_host_that_vanished_are_closed(
        self, hosts: Hosts, tmp_path: Path
    ) -> None:
        async with two_hosts(hosts, tmp_path) as (system, node):
            echo = await system.spawn(Echo, 1, node="b", name="echo")
            assert await echo.ask(Ping(n=1)) == Pong(n=1)  # b's processes connected here
            assert established_from(hosts.b)
            hosts.cut()
            try:
                node.kill()  # b's processes end; no FIN or RST crosses the cut to here
                # ZeroMQ's heartbeat ends them (3 heartbeats unanswered); before, they
                # stayed established for good, a descriptor each.
                for _ in range(100):  # 10 s: the kernel's table, read from outside
                    if not established_from(hosts.b):
                        break
                    await anyio.sleep(0.1)  # sync-ok: polling the kernel's connection table
                else:
                    pytest.fail(f"still established from {hosts.b}: {established_from(hosts.b)}")
            finally:
                hosts.restore()


def says_a_line_within(node: NodeProcess, timeout: float) -> str:
    """The next line the node writes on its standard output within ``timeout`` seconds
    (``""``: none)."""
    assert node.proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(node.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return node.proc.stdout.readline().decode()


def established_from(host: str) -> list[str]:
    """The tcp connections of this host established with ``host`` (``ss``'s lines)."""
    lines = subprocess.run(
        ["ss", "-Htn", "state", "established", "dst", host],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    return lines.splitlines()


class TestTheRootsTable:
    """JOIN and NODES as the root answers them (its own reply inbox asked, on one host)."""

    async def test_a_name_belongs_to_one_live_node_and_joining_again_is_idempotent(
        self, tmp_path: Path
    ) -> None:
        async with ActorSystem(transport="tcp", keys=tmp_path / "keys", heartbeat=60) as system:
            node = system.station

            async def join(name: str, port: int) -> list[str]:
                hello = NodeHello(name, f"tcp://127.0.0.1:{port}", "127.0.0.1")
                body = await node.request(system.address, Kind.JOIN, body_encoder.encode(hello), 5)
                return [n.name for n in nodes_decoder.decode(body).nodes]

            assert await join("x", 1) == ["x"]
            assert await join("x", 1) == ["x"]  # the same node again
            with pytest.raises(RemoteActorError, match="already in the system"):
                await join("x", 2)
            assert await join("y", 3) == ["x", "y"]
            assert [n.address for n in await system.nodes()] == [
                "tcp://127.0.0.1:1",
                "tcp://127.0.0.1:3",
            ]


class TestTheNodeCommand:
    def test_its_help_names_every_option_and_a_bad_call_exits_2(self) -> None:
        helped = subprocess.run(
            [sys.executable, "-m", "runtime", "node", "--help"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert helped.returncode == 0
        for option in ("--system", "--keys", "--name", "--host", "--heartbeat", "--stdin-eof"):
            assert option in helped.stdout
        missing = subprocess.run(
            [sys.executable, "-m", "runtime", "node", "--name", "b"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert missing.returncode == 2
        assert "--system" in missing.stderr
        nothing = subprocess.run(
            [sys.executable, "-m", "runtime"], capture_output=True, text=True, timeout=30
        )
        assert nothing.returncode == 2
        assert "python -m runtime node" in nothing.stderr

    async def test_a_node_that_cannot_join_says_why(self, tmp_path: Path) -> None:
        async with ActorSystem(
            name="root", transport="tcp", tcp_host="127.0.0.1", keys=tmp_path / "keys",
            heartbeat=0.5,
        ) as system:  # fmt: skip
            other = tmp_path / "other"
            Keys.load(other)  # another system's key: its handshakes fail, unanswered
            command = [sys.executable, "-m", "runtime", "node", "--system", system.address]
            command += ["--keys", str(other), "--name", "b", "--host", "127.0.0.1"]
            node = await anyio.to_thread.run_sync(
                lambda: subprocess.Popen(
                    [*command, "--heartbeat", "0.5"], stderr=subprocess.PIPE, text=True
                )
            )
            try:
                with anyio.fail_after(20):
                    line = await anyio.to_thread.run_sync(
                        first_line_with, node.stderr, "no answer from the root",
                        abandon_on_cancel=True,
                    )  # fmt: skip
            finally:
                node.kill()
                node.wait()
                if node.stderr is not None:
                    node.stderr.close()
        assert system.address in line
        assert "system.key" in line

    async def test_a_node_given_the_roots_host_name_joins_once(self, tmp_path: Path) -> None:
        keys = tmp_path / "keys"
        async with ActorSystem(
            name="root", transport="tcp", tcp_host="127.0.0.1", keys=keys, heartbeat=0.5
        ) as system:
            port = system.address.rpartition(":")[2]
            command = [sys.executable, "-m", "runtime", "node", "--name", "b"]
            command += ["--system", f"tcp://localhost:{port}", "--keys", str(keys)]
            command += ["--host", "127.0.0.1", "--heartbeat", "0.5"]
            node = await anyio.to_thread.run_sync(
                lambda: subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            )
            try:
                with anyio.fail_after(20):
                    first = await anyio.to_thread.run_sync(
                        first_line_with, node.stdout, " joined ", abandon_on_cancel=True
                    )
                assert first
                # The root's pings name it by its address, not by "localhost": before, the
                # node took them for a stranger's, counted the root lost and joined again
                # at every heartbeat. Six heartbeats without a second join (an absence can
                # only be waited for).
                with anyio.move_on_after(3.0):
                    again = await anyio.to_thread.run_sync(
                        first_line_with, node.stdout, " joined ", abandon_on_cancel=True
                    )
                    pytest.fail(f"the node joined again: {again}")
            finally:
                node.kill()
                node.wait()
                if node.stdout is not None:
                    node.stdout.close()

    def test_keys_it_cannot_use_and_a_wildcard_host_exit_2_in_one_line(
        self, tmp_path: Path
    ) -> None:
        def node(keys: Path, host: str = "127.0.0.1") -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "runtime", "node", "--system", "tcp://127.0.0.1:9"]
            command += ["--keys", str(keys), "--name", "b", "--host", host]
            return subprocess.run(command, capture_output=True, text=True, timeout=30)

        empty = tmp_path / "empty"
        empty.mkdir()
        missing = node(empty)  # a mistyped directory: no key is made there
        assert missing.returncode == 2
        assert "no system.key there" in missing.stderr
        assert os.listdir(empty) == []
        keys = tmp_path / "keys"
        Keys.load(keys)  # the system's own key, as a root makes it
        for host in ("0.0.0.0", "::"):  # what the node must refuse
            wildcard = node(keys, host)
            assert wildcard.returncode == 2
            assert "the node tells the system this address" in wildcard.stderr
        os.chmod(keys / "system.key", 0o644)
        readable = node(keys)
        assert readable.returncode == 2
        assert "Traceback" not in readable.stderr

    @pytest.mark.parametrize(
        ("damage", "named"),
        [
            ("cut", "system.key holds no system key: Input data was truncated"),
            ("short-secret", "its secret key is not a CURVE key (40 characters of Z85, not"),
            ("bad-public", "its public key is not a CURVE key (40 characters of Z85, not"),
            ("foreign-public", "its public key is not its secret key's (another system's"),
        ],
    )
    def test_a_key_file_it_cannot_use_exits_2_naming_what_is_wrong(
        self, tmp_path: Path, damage: str, named: str
    ) -> None:
        # Before, each of these started the node: a bad key failed its first bind with a
        # traceback ("Invalid argument", a KeyError in Z85) and a public key not the
        # secret's completed no handshake, the node asking for ever in silence.
        keys = tmp_path / "keys"
        Keys.load(keys)
        key_file = keys / "system.key"
        text = key_file.read_bytes()
        pair = msgspec.json.decode(text)
        if damage == "cut":
            key_file.write_bytes(text[: len(text) // 2])
        elif damage == "short-secret":
            pair["secret"] = pair["secret"][:20]
        elif damage == "bad-public":
            pair["public"] = "x" * 40  # base64 of bytes outside Z85
        else:
            pair["public"] = msgspec.json.decode(msgspec.json.encode(Keys.new()))["public"]
        if damage != "cut":
            key_file.write_bytes(msgspec.json.encode(pair))
        command = [sys.executable, "-m", "runtime", "node", "--system", "tcp://127.0.0.1:9"]
        command += ["--keys", str(keys), "--name", "b", "--host", "127.0.0.1"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert named in done.stderr.splitlines()[-1], done.stderr
        with pytest.raises(ValueError, match=r"system\.key holds no system key"):
            Keys.load(keys)  # a root given the directory is told the same

    @pytest.mark.parametrize(
        ("option", "value", "named"),
        [
            ("--heartbeat", "0", "argument --heartbeat: 0: give a finite number of seconds"),
            ("--heartbeat", "-1", "argument --heartbeat: -1: give a finite number of seconds"),
            ("--heartbeat", "nan", "argument --heartbeat: nan: give a finite number of seconds"),
            ("--heartbeat", "inf", "argument --heartbeat: inf: give a finite number of seconds"),
            ("--heartbeat", "1e7", "argument --heartbeat: 1e7: give a finite number of seconds"),
            ("--host", "not-a-host", "--host not-a-host: this host cannot bind there"),
            ("--host", "192.0.2.1", "--host 192.0.2.1: this host cannot bind there"),
            ("--system", "garbage", "--system garbage: give the root's address as tcp://"),
            ("--system", "tcp://127.0.0.1", "--system tcp://127.0.0.1: give the root's"),
            ("--system", "tcp://127.0.0.1:99999", "--system tcp://127.0.0.1:99999: give"),
            ("--name", "", "--name '': give the node a name"),
            ("--name", " ", "--name ' ': give the node a name"),
        ],
        ids=[
            "heartbeat-0",
            "heartbeat-negative",
            "heartbeat-nan",
            "heartbeat-inf",
            "heartbeat-beyond-a-day",
            "host-unknown",
            "host-not-this-hosts",
            "system-garbage",
            "system-no-port",
            "system-port-out-of-range",
            "name-empty",
            "name-blank",
        ],
    )
    def test_a_bad_value_exits_2_naming_it_before_the_node_starts(
        self, option: str, value: str, named: str, tmp_path: Path
    ) -> None:
        """Before, each was a traceback and status 1 once the system had started opening
        (1e7 s: libzmq's heartbeat settings overflowed), and an empty name was taken.
        --stdin-eof on an empty stdin: a node that wrongly starts stops at once."""
        keys = tmp_path / "keys"
        Keys.load(keys)  # the system's own key, as a root makes it
        given = {"--system": "tcp://127.0.0.1:9", "--name": "b", "--host": "127.0.0.1"}
        given[option] = value
        command = [sys.executable, "-m", "runtime", "node", "--keys", str(keys), "--stdin-eof"]
        command += [word for pair in given.items() for word in pair]
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.startswith("usage: python -m runtime node")
        assert done.stderr.splitlines()[-1].startswith(f"python -m runtime node: error: {named}")
