"""Testing your actors with pytest and anyio: handlers alone, in-process, real processes.

This file is a pytest module. ``python docs/examples/testing_actors.py`` runs it through
pytest; in your project, copy the fixtures to ``conftest.py`` and run ``pytest``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

from runtime import (
    Actor,
    ActorRef,
    ActorSystem,
    Cause,
    Message,
    RemoteActorError,
    Request,
    handler,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.anyio


# -- the actors under test --------------------------------------------------------------------


class Withdraw(Request["Balance"]):
    amount: int


class Balance(Message):
    value: int


class Crash(Message):
    """Fail the whole actor."""


class Failed(Message):
    """An account's last words, told from its ``on_failure`` hook."""

    error: str


class Account(Actor[Withdraw | Crash]):
    """Keeps a balance; reports every change, and its own failure, to an optional auditor."""

    def __init__(self, opening: int = 0, auditor: ActorRef[Balance | Failed] | None = None) -> None:
        self.balance = opening
        self.auditor = auditor

    @handler
    async def withdraw(self, msg: Withdraw) -> Balance:
        if msg.amount > self.balance:
            raise ValueError(f"insufficient funds: {self.balance} < {msg.amount}")
        self.balance -= msg.amount
        if self.auditor is not None:
            await self.auditor.tell(Balance(value=self.balance))
        return Balance(value=self.balance)

    @handler
    def crash_now(self, msg: Crash) -> None:
        self.crash(RuntimeError("corrupt ledger"))

    async def on_failure(self, error: BaseException) -> None:
        if self.auditor is not None:
            await self.auditor.tell(Failed(error=str(error)))


class Audit:
    """What an Auditor saw. It runs in the test's process (process=False), so the test can
    share this object with it and wait on its event: no sleeping, no polling."""

    def __init__(self) -> None:
        self.seen: list[Balance | Failed] = []
        self.changed = anyio.Event()

    async def wait_for(self, count: int) -> list[Balance | Failed]:
        while len(self.seen) < count:
            await self.changed.wait()
        return self.seen


class Auditor(Actor[Balance | Failed]):
    def __init__(self, audit: Audit) -> None:
        self.audit = audit

    @handler
    def record(self, msg: Balance | Failed) -> None:  # one handler for both types
        self.audit.seen.append(msg)
        self.audit.changed.set()
        self.audit.changed = anyio.Event()


class Gate(Actor[Balance]):
    """Holds its first message until the test opens it, so its mailbox fills up."""

    def __init__(self, opened: anyio.Event, seen: list[int]) -> None:
        self.opened = opened
        self.seen = seen

    @handler
    async def balance(self, msg: Balance) -> None:
        await self.opened.wait()
        self.seen.append(msg.value)


# -- fixtures (conftest.py material) ----------------------------------------------------------


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """tokenyard runs on asyncio."""
    return "asyncio"


def _children() -> set[int]:
    """Pids of this process's children, zombies included (Linux: /proc)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except FileNotFoundError:
            continue  # a thread that ended during the scan
    return pids


def _ipc_dirs() -> set[Path]:
    """The private directories this process's actor systems have created."""
    return set(Path(tempfile.gettempdir()).glob(f"tokenyard-{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves an actor process or a system directory behind."""
    procs, dirs = _children(), _ipc_dirs()
    yield
    assert not _children() - procs, "actor processes outlived the test"
    assert not _ipc_dirs() - dirs, "an ActorSystem directory outlived the test"


# -- tests ------------------------------------------------------------------------------------


async def test_a_handler_is_a_plain_method() -> None:
    # No system, no sockets: the handler's logic alone.
    account = Account(opening=10)
    assert await account.withdraw(Withdraw(amount=4)) == Balance(value=6)


def test_a_handler_answering_the_wrong_type_is_refused_where_the_class_is_written() -> None:
    # Withdraw is a Request[Balance]: the class statement itself raises.
    with pytest.raises(TypeError, match="Withdraw is a request answered with Balance"):

        class Careless(Actor[Withdraw]):
            @handler
            def withdraw(self, msg: Withdraw) -> Failed:
                return Failed(error="not a balance")


async def test_an_overdraft_comes_back_as_remote_actor_error() -> None:
    async with ActorSystem() as system:
        account = await system.spawn(Account, 10, process=False)  # a task in this loop
        with pytest.raises(RemoteActorError) as info:
            await account.ask(Withdraw(amount=50))
        assert info.value.type_name == "builtins.ValueError"
        assert await account.ask(Withdraw(amount=5)) == Balance(value=5)  # still serving


async def test_every_withdrawal_reaches_the_auditor_across_processes() -> None:
    audit = Audit()
    async with ActorSystem() as system:
        auditor = await system.spawn(Auditor, audit, process=False)
        account = await system.spawn(Account, 100, auditor)  # its own process
        for _ in range(3):
            await account.tell(Withdraw(amount=10))
        with anyio.fail_after(10):  # a bound on the wait, not a sleep
            seen = await audit.wait_for(3)
        assert seen == [Balance(value=90), Balance(value=80), Balance(value=70)]


async def test_a_crash_is_seen_through_watch_and_on_failure_has_the_last_word() -> None:
    audit = Audit()
    async with ActorSystem() as system:
        auditor = await system.spawn(Auditor, audit, process=False)
        account = await system.spawn(Account, 1, auditor)
        watch = system.watch(account)
        await account.tell(Crash())
        with anyio.fail_after(10):
            down = await watch
            seen = await audit.wait_for(1)
        assert down.cause is Cause.EXCEPTION
        assert down.reason == "exception: builtins.RuntimeError: corrupt ledger"
        assert seen == [Failed(error="corrupt ledger")]


async def test_try_tell_refuses_at_once_when_the_mailbox_is_full() -> None:
    opened = anyio.Event()
    seen: list[int] = []
    async with ActorSystem(hwm=2, rcvhwm=2) as system:
        gate = await system.spawn(Gate, opened, seen, process=False)
        sent = 0
        while gate.try_tell(Balance(value=sent)):  # never waits: False once full
            sent += 1
        assert sent >= 1  # the queue (hwm=2) took what it could; then a refusal, not a wait
        opened.set()
        await system.stop(gate)  # handles everything told before the stop
    assert seen == list(range(sent))


if __name__ == "__main__":
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    sys.exit(subprocess.run(command, check=False).returncode)
