"""The fork server: actors forked from a preloaded process, as the root's own children."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from actors import Pipeline
from runtime import ActorRef, ActorSystem, ChildSpec, SpawnError, Supervisor, WhichChildren
from runtime._spawn import child_env
from tests.conftest import actor_pids, child_pids, exits_within

from . import _putenv as putenv
from ._forked import ExitWith, Forked, Here, Tokenize, Tokenizing, WhereAmI
from ._threaded import Threaded

if TYPE_CHECKING:
    from collections.abc import Iterator

    from runtime._forking import ForkServer


def server_of(system: ActorSystem) -> ForkServer:
    server = system.launcher.server
    assert server is not None
    assert server.pid is not None
    return server


async def where(ref: ActorRef[Any]) -> Here:
    here = await ref.ask(WhereAmI())
    assert isinstance(here, Here)
    return here


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class TestForkedActors:
    async def test_an_actor_is_forked_from_the_fork_server_as_the_roots_own_child(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Forked, name="forked")
            here = await where(ref)
            server = server_of(system)
            # Its module's top level ran in the server; the process is ours, not the server's.
            assert here.imported_in == server.pid
            assert here.ppid == os.getpid()
            assert here.pid in child_pids()
            assert here.pid == system.pid_of(ref)
            # Its own process group, in the root's session, as a fresh interpreter has.
            assert here.pgid == here.pid
            assert here.sid == os.getsid(0)
            title = Path(f"/proc/{here.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            assert title == f"tokenyard::forked:{here.pid}"
            # The server forked while single-threaded, and still is.
            assert threads_of(server.pid) == 1

    async def test_a_forked_actor_collects_but_never_scans_what_it_shares_with_its_server(
        self,
    ) -> None:
        async with ActorSystem() as system:
            here = await where(await system.spawn(Forked, name="forked"))
            # The server never collects (its freed blocks would be holes in shared pages)
            # and froze what it holds before forking; the child collects its own objects.
            assert (here.imported_collecting, here.collecting) == (False, True)
            assert here.frozen > 10_000
        async with ActorSystem(start="spawn") as system:
            fresh = await where(await system.spawn(Forked, name="fresh"))
            assert (fresh.imported_collecting, fresh.collecting, fresh.frozen) == (True, True, 0)

    async def test_a_forked_actor_has_the_environment_and_directory_of_its_parent_now(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        # As a fresh interpreter would: variables set, changed and removed since the fork
        # server started are its parent's, the ones left alone too.
        monkeypatch.setenv("TOKENYARD_TEST_KEPT", "kept")
        monkeypatch.setenv("TOKENYARD_TEST_CHANGED", "before")
        monkeypatch.setenv("TOKENYARD_TEST_REMOVED", "removed")
        started_in = os.getcwd()
        async with ActorSystem() as system:
            before = await where(await system.spawn(Forked, name="before"))
            assert before.environ == child_env()
            monkeypatch.setenv("TOKENYARD_TEST_CHANGED", "after")
            monkeypatch.delenv("TOKENYARD_TEST_REMOVED")
            monkeypatch.setenv("TOKENYARD_TEST_ADDED", "added")
            monkeypatch.chdir(tmp_path)
            after = await where(await system.spawn(Forked, name="after"))
            assert after.imported_in == before.imported_in == server_of(system).pid
        assert after.environ == child_env()
        assert {k: v for k, v in after.environ.items() if k.startswith("TOKENYARD_TEST_")} == {
            "TOKENYARD_TEST_KEPT": "kept",
            "TOKENYARD_TEST_CHANGED": "after",
            "TOKENYARD_TEST_ADDED": "added",
        }
        assert (before.cwd, after.cwd) == (started_in, str(tmp_path))

    async def test_a_forked_actor_has_its_parents_environment_whatever_an_import_changed(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The preloaded module changes the server's C environment behind os.environ's
        # back; a forked actor changes only the variables whose os.environ value differs
        # from its parent's, so the server writes os.environ to its C environment again.
        monkeypatch.setenv(putenv.VARIABLE, "parent's")
        async with ActorSystem(preload=["tests.integration._putenv"]) as system:
            ref = await system.spawn(putenv.ReadsItsEnvironment, name="reads")
            assert await ref.ask(putenv.WhatIsSet()) == putenv.IsSet(value="parent's")

    async def test_start_spawn_gives_a_fresh_interpreter_per_spawn_or_per_system(self) -> None:
        async with ActorSystem() as system:
            fresh = await where(await system.spawn(Forked, name="fresh", start="spawn"))
            assert fresh.imported_in == fresh.pid
            assert system.launcher.server is None  # nothing forked: no server started
        async with ActorSystem(start="spawn") as system:
            fresh = await where(await system.spawn(Forked, name="fresh"))
            assert fresh.imported_in == fresh.pid
            forked = await where(await system.spawn(Forked, name="f", start="fork-server"))
            assert forked.imported_in == server_of(system).pid

    async def test_an_unknown_start_method_names_the_choices(self) -> None:
        with pytest.raises(ValueError, match="choose 'fork-server' or 'spawn'"):
            ActorSystem(start="forkserver")  # type: ignore[arg-type] # the wrong name, on purpose
        async with ActorSystem() as system:
            with pytest.raises(ValueError, match="choose 'fork-server' or 'spawn'"):
                await system.spawn(Forked, start="exec")  # the wrong name, on purpose

    async def test_preloaded_modules_run_once_in_an_eager_fork_server(self) -> None:
        async with ActorSystem(
            preload=("tests.integration._forked",), eager_fork_server=True
        ) as system:
            server = server_of(system)  # started with the system, before any spawn
            refs = [await system.spawn(Forked, name=f"f{i}") for i in range(3)]
            heres = [await where(ref) for ref in refs]
            assert {here.imported_in for here in heres} == {server.pid}
            assert len({here.pid for here in heres}) == 3
            assert server.forked == 3

    @pytest.mark.parametrize(
        ("told", "exitcode", "signum"), [(3, 3, None), (-signal.SIGKILL, -9, signal.SIGKILL)]
    )
    async def test_the_down_of_a_forked_actor_has_its_exit_status_and_signal(
        self, told: int, exitcode: int, signum: int | None
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Forked, name="exiting")
            watch = system.watch(ref)
            await ref.tell(ExitWith(status=told))
            with anyio.fail_after(10):
                down = await watch
            assert down.exitcode == exitcode
            assert down.signal == signum

    async def test_a_killed_actor_is_restarted_through_the_fork_server(self) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(
                Supervisor,
                children=[ChildSpec(Forked, name="w")],
                max_restarts=10,
                backoff=0.0,
                name="sup",
                process=False,  # the root's own fork server forks the child
            )
            first = await system.lookup("w")
            before = await where(first)
            server = server_of(system)
            watch = system.watch(first)
            os.kill(before.pid, signal.SIGKILL)
            with anyio.fail_after(10):
                down = await watch
            assert down.signal == signal.SIGKILL
            with anyio.fail_after(10):
                while True:
                    refs = (await sup.ask(WhichChildren())).refs
                    again = refs.get("w")
                    if again is not None and again.incarnation > first.incarnation:
                        break
            after = await where(again)
            assert after.pid != before.pid
            assert after.imported_in == server.pid
            assert server.forked == 2


@contextlib.contextmanager
def import_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A FIFO that holds the import of ``tests.integration._forked`` in a fork server."""
    with tempfile.TemporaryDirectory() as tmp:
        gate = os.path.join(tmp, "gate")
        os.mkfifo(gate)
        monkeypatch.setenv("TOKENYARD_TEST_IMPORT_GATE", gate)
        try:
            yield gate
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(gate)


def live_actor_pids() -> set[int]:
    """`actor_pids` but zombies: a killed fork server not yet reaped is one (and its command
    line, which names it a fork server, is empty by then)."""
    return {pid for pid in actor_pids() if _state(pid) != "Z"}


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rpartition(")")[2].split()[0]


class TestForkServerDeath:
    async def test_a_killed_fork_server_is_replaced_and_its_actors_live_on(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Forked, name="survivor")
            old = server_of(system)
            assert old.pid is not None
            os.kill(old.pid, signal.SIGKILL)
            assert exits_within(old.pid, 5.0)
            assert (await where(ref)).ppid == os.getpid()  # not the server's: untouched
            other = await where(await system.spawn(Forked, name="other"))
            new = server_of(system)
            assert new is not old
            assert other.imported_in == new.pid
            assert old.pid not in child_pids()  # the dead one was reaped

    async def test_a_spawn_in_flight_when_the_server_dies_is_retried_on_a_new_one(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with import_gate(monkeypatch) as gate:
            async with ActorSystem() as system:
                spawned: list[ActorRef[Any]] = []

                async def spawn() -> None:
                    spawned.append(await system.spawn(Forked, name="late"))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(spawn)
                    # Opening the FIFO to write returns once the server opened it to read:
                    # it is inside the actor module's import, with the spawn in flight.
                    writer = await anyio.to_thread.run_sync(os.open, gate, os.O_WRONLY)
                    server = server_of(system)
                    assert server.pid is not None
                    os.kill(server.pid, signal.SIGKILL)
                    os.unlink(gate)  # the next server's import passes through
                    os.close(writer)
                (ref,) = spawned
                here = await where(ref)
                assert here.imported_in != server.pid
                assert here.imported_in == server_of(system).pid

    async def test_a_fork_server_stuck_in_an_import_fails_the_spawn_in_its_timeout(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with import_gate(monkeypatch):
            async with ActorSystem() as system:
                with pytest.raises(SpawnError, match=r"spawn_timeout"):
                    await system.spawn(Forked, name="stuck", spawn_timeout=1.0)
                server = server_of(system)
                assert server.pid is not None
                assert exits_within(server.pid, 5.0)  # killed, as stuck
                assert actor_pids() - {server.pid} == set()  # it forked nothing

    async def test_spawns_queued_behind_a_busy_fork_server_all_start_once_it_is_free(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Each request carries sys.path: made long, a few requests fill the socket's send
        # buffer while the server is held in an import, and the rest wait for room at once.
        # One whose timeout ends while it waits fails alone: a request never sent says
        # nothing of the server (busy with the ones before it), which is not killed.
        monkeypatch.setattr(sys, "path", [*sys.path, LONG_PATH])
        with import_gate(monkeypatch) as gate:
            async with ActorSystem() as system:
                spawned: list[ActorRef[Any]] = []

                async def spawn(i: int) -> None:
                    spawned.append(await system.spawn(Forked, name=f"queued-{i}"))

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        for i in range(QUEUED):
                            tg.start_soon(spawn, i)
                        writer = await anyio.to_thread.run_sync(os.open, gate, os.O_WRONLY)
                        await anyio.wait_all_tasks_blocked()  # every request sent, or waiting
                        server = server_of(system).pid
                        with pytest.raises(SpawnError, match=r"took no request.*spawn_timeout"):
                            await system.spawn(Forked, name="impatient", spawn_timeout=0.5)
                        os.unlink(gate)
                        os.close(writer)
                assert len(spawned) == QUEUED
                assert server_of(system).pid == server  # not killed as stuck
                assert len(actor_pids() - {server}) == QUEUED

    async def test_a_spawn_that_finds_no_room_on_a_stuck_fork_server_fails_in_its_timeout(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(sys, "path", [*sys.path, LONG_PATH])
        with import_gate(monkeypatch):
            async with ActorSystem(eager_fork_server=True) as system:
                stuck = server_of(system)
                failed: list[str] = []

                async def spawn(i: int) -> None:
                    with pytest.raises(SpawnError, match=r"spawn_timeout") as info:
                        await system.spawn(Forked, name=f"stuck-{i}", spawn_timeout=2.0)
                    failed.append(str(info.value))

                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        for i in range(QUEUED):
                            tg.start_soon(spawn, i)
                assert len(failed) == QUEUED
                assert stuck.pid is not None
                assert exits_within(stuck.pid, 5.0)  # killed, as stuck
                # Spawns retried on a new server (also stuck, or given too little time by
                # them to get ready) forked nothing either.
                assert live_actor_pids() == set()

    async def test_a_retried_spawn_fails_alone_when_the_new_server_is_not_ready_in_its_time(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The first server dies while a spawn waits for it to preload; the spawn's time runs
        # out while the server that replaced it still preloads. That server is not killed
        # for it: it was not given a whole spawn_timeout. A spawn that began on it judges it.
        with import_gate(monkeypatch) as gate:
            async with ActorSystem(
                preload=("tests.integration._forked",), eager_fork_server=True
            ) as system:
                first = server_of(system)
                assert first.pid is not None
                # Returns once the first server is inside its preload; held open, it keeps
                # the next server's preload waiting too.
                writer = await anyio.to_thread.run_sync(os.open, gate, os.O_WRONLY)
                try:
                    async with anyio.create_task_group() as tg:

                        async def spawn() -> None:
                            with pytest.raises(SpawnError, match=r"replaced it was not ready"):
                                await system.spawn(Forked, name="retried", spawn_timeout=2.0)

                        tg.start_soon(spawn)
                        await anyio.wait_all_tasks_blocked()  # waiting for the preload
                        os.kill(first.pid, signal.SIGKILL)
                    second = server_of(system)
                    assert second.pid is not None
                    assert second.pid != first.pid
                    assert not second.gone
                    os.kill(second.pid, 0)  # alive: not killed by the retry
                    with pytest.raises(SpawnError, match=r"did not finish importing preload"):
                        await system.spawn(Forked, name="judge", spawn_timeout=0.5)
                    assert exits_within(second.pid, 5.0)
                finally:
                    os.close(writer)
                assert live_actor_pids() == set()


#: A ``sys.path`` entry (of no directory) that makes each fork request about 32 KiB: a few
#: fill the fork server's socket buffer. ``QUEUED`` spawns at once then wait for room.
LONG_PATH = "/nonexistent/" + "/".join(["x" * 200] * 160)
QUEUED = 24


class TestThreads:
    async def test_a_preloaded_module_that_starts_a_thread_is_refused_naming_the_knob(
        self,
    ) -> None:
        async with ActorSystem(preload=("tests.integration._threaded",)) as system:
            with pytest.raises(SpawnError, match=r"_threaded.*started a thread.*start='spawn'"):
                await system.spawn(Forked, name="never")
            # Refused again at once, without a new server importing it again.
            with pytest.raises(SpawnError, match="preload"):
                await system.spawn(Forked, name="never-again")
            # The fresh interpreter still works.
            fresh = await where(await system.spawn(Forked, name="fresh", start="spawn"))
            assert fresh.imported_in == fresh.pid

    async def test_an_actor_module_that_starts_a_thread_starts_in_a_fresh_interpreter(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING, logger="tokenyard.system"):
            async with ActorSystem() as system:
                threaded = await where(await system.spawn(Threaded, name="threaded"))
                assert threaded.imported_in == threaded.pid  # its own top level: fresh
                refusing = system.launcher.server
                assert refusing is not None
                assert refusing.pid is not None
                assert exits_within(refusing.pid, 5.0)  # it forks no more
                # Others are still forked, by a new server that never imported it.
                forked = await where(await system.spawn(Forked, name="forked"))
                new = server_of(system)
                assert forked.imported_in == new.pid
                assert threads_of(new.pid if new.pid else 0) == 1
                again = await where(await system.spawn(Threaded, name="threaded-2"))
                assert again.imported_in == again.pid
        warnings = [r.getMessage() for r in caplog.records if "started a thread" in r.getMessage()]
        assert len(warnings) == 1
        assert "tests.integration._threaded" in warnings[0]
        assert "start='spawn'" in warnings[0]


class TestPreloadedPipeline:
    async def test_a_child_tokenizes_after_the_fork_server_preloaded_actors(self) -> None:
        async with ActorSystem(preload=("actors",), eager_fork_server=True) as system:
            ref = await system.spawn(Tokenizing, name="tokenizing")
            tokens = await ref.ask(Tokenize(text="héllo wörld, 你好 🦊"))
            assert tokens.text == "héllo wörld, 你好 🦊"
            server = server_of(system)
            assert server.pid is not None
            assert threads_of(server.pid) == 1  # its preloads started no pool

    async def test_a_killed_pipeline_worker_comes_back_through_the_fork_server(self) -> None:
        async with Pipeline(workers=2) as pipeline:
            server = server_of(pipeline.system)
            forked = server.forked
            old = pipeline.kill_worker(0)
            with anyio.fail_after(30):
                await pipeline.wait_worker(0, after=old.incarnation)
            result = await pipeline.generate("hello again", max_new_tokens=4)
            assert result.completion_tokens == 4
            assert server_of(pipeline.system) is server
            assert server.forked == forked + 1
            assert threads_of(server.pid if server.pid else 0) == 1


class TestCancelledSpawns:
    async def test_a_spawn_cancelled_by_asyncio_while_forking_leaves_no_process(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # asyncio's own cancellation (``wait_for``, ``asyncio.timeout``, ``Task.cancel``)
        # passes anyio's shielded scopes: the request in flight, its child forked once the
        # server answers, must still be known here, and that child killed and reaped.
        with import_gate(monkeypatch) as gate:
            async with ActorSystem(eager_fork_server=True) as system:
                server = server_of(system)
                task = asyncio.ensure_future(system.spawn(Forked, name="given-up"))
                # Returns once the server is inside the actor module's import: the fork
                # request is in flight.
                writer = await anyio.to_thread.run_sync(os.open, gate, os.O_WRONLY)
                task.cancel()
                os.unlink(gate)
                os.close(writer)
                with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
                    await task
                # The server answers requests in order: once this one is ready, the
                # cancelled one's child was forked (and is gone again).
                with anyio.fail_after(10):
                    later = await where(await system.spawn(Forked, name="later"))
                # Not even a zombie (a forked child bears the server's command line until
                # it names itself: `actor_pids` would not see it).
                assert child_pids() == {server.pid, later.pid}

    async def test_a_close_cancelled_by_asyncio_still_kills_and_reaps_the_server(self) -> None:
        # A server that cannot exit on its socket's end of file (stopped here; stuck in
        # real life) is waited for, then killed: asyncio's cancellation in that wait
        # passed anyio's shielded scope, and left it running and unreaped.
        async with ActorSystem(eager_fork_server=True) as system:
            server = server_of(system)
            pid = server.pid
            assert pid
            os.kill(pid, signal.SIGSTOP)
            try:
                closing = asyncio.ensure_future(server.aclose())
                await anyio.wait_all_tasks_blocked()  # in its wait for the server's exit
                closing.cancel()
                with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
                    await closing
                assert server.process is not None
                assert server.process.returncode == -signal.SIGKILL
                assert pid not in child_pids()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
