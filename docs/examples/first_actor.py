"""A first actor: spawn it in a process and in the event loop, ask, tell, fail, stop.

Run it with ``python docs/examples/first_actor.py``; the getting-started page walks through it.
"""

from __future__ import annotations

import anyio

from runtime import (
    Actor,
    ActorDeadError,
    ActorSystem,
    AskTimeoutError,
    Message,
    RemoteActorError,
    Request,
    handler,
)


class Deposit(Message):
    """Add ``amount`` to the balance (a tell: no reply)."""

    amount: int


class Withdraw(Request["Balance"]):
    """Take ``amount`` from the balance; the reply is the new ``Balance``."""

    amount: int


class GetBalance(Request["Balance"]):
    """Ask for the balance."""


class Balance(Message):
    """A reply: the balance after the request."""

    value: int


class Nap(Request[None]):
    """Sleep in the handler for ``seconds`` (to show an ask timing out)."""

    seconds: float


class Account(Actor[Deposit | Withdraw | GetBalance | Nap]):
    """Keeps one balance. Its state is private: only messages reach it."""

    def __init__(self, opening: int = 0) -> None:
        self.balance = opening

    @handler
    def deposit(self, msg: Deposit) -> None:
        self.balance += msg.amount

    @handler
    def withdraw(self, msg: Withdraw) -> Balance:
        if msg.amount > self.balance:
            raise ValueError(f"cannot withdraw {msg.amount}: the balance is {self.balance}")
        self.balance -= msg.amount
        return Balance(value=self.balance)

    @handler
    def get_balance(self, msg: GetBalance) -> Balance:
        return Balance(value=self.balance)

    @handler
    async def nap(self, msg: Nap) -> None:
        await anyio.sleep(msg.seconds)


async def main() -> None:
    async with ActorSystem() as system:
        # A process of its own (the default), then the same class as a task in this loop.
        account = await system.spawn(Account, 100, name="account")
        local = await system.spawn(Account, name="local", process=False)

        for ref in (account, local):
            await ref.tell(Deposit(amount=50))  # returns once the message is queued
            reply: Balance = await ref.ask(Withdraw(amount=30))  # waits for the handler
            print(f"{ref.name}: balance {reply.value}")

        try:
            await account.ask(Withdraw(amount=1_000))
        except RemoteActorError as err:
            # The handler's exception, carried back as data; the actor lives on.
            print(f"refused: {err.type_name}: {err.remote_message}")

        try:
            await account.ask(Nap(seconds=1.0), timeout=0.1)
        except AskTimeoutError:
            print("no reply within 0.1 s (the handler still runs to its end)")

        down = await system.stop(account)  # queued messages are handled first
        print(f"stopped: reason={down.reason!r} exitcode={down.exitcode}")
        try:
            await account.ask(GetBalance())
        except ActorDeadError as err:
            print(f"after the stop: {err}")
    # Leaving the block stopped `local` too and removed the system's ipc directory.


if __name__ == "__main__":
    anyio.run(main)
