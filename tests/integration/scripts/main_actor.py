"""An actor class defined in a script's __main__, spawned in its own process."""

from __future__ import annotations

import anyio

from runtime import Actor, ActorSystem, Message, Request, handler


class Greet(Request["Greeting"]):
    who: str


class Greeting(Message):
    text: str


class Greeter(Actor[Greet]):
    @handler
    def greet(self, msg: Greet) -> Greeting:
        return Greeting(text=f"hello, {msg.who}")


async def main() -> None:
    async with ActorSystem() as system:
        greeter = await system.spawn(Greeter, name="greeter")
        reply = await greeter.ask(Greet(who="main"))
        print(reply.text)


if __name__ == "__main__":
    anyio.run(main)
