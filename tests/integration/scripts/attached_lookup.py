"""An attached client in a process of its own: ``attached_lookup.py CREDENTIALS NAME...``
joins the running system and looks each name up, printing one JSON line per name (its
ref's name and incarnation and the answer of a `Ping` asked of it, or the error)."""

from __future__ import annotations

import asyncio
import json
import sys

from runtime import ActorNotFoundError, ActorSystem, Credentials
from tests.integration._actors import Ping


async def main(path: str, names: list[str]) -> None:
    async with ActorSystem(attach=Credentials.load(path), name="client") as client:
        for name in names:
            try:
                ref = await client.lookup(name, timeout=10)
            except ActorNotFoundError as err:
                print(json.dumps({"name": name, "error": str(err)}), flush=True)
                continue
            pong = await ref.ask(Ping(n=7), timeout=10)
            line = {"name": ref.name, "incarnation": ref.incarnation, "pong": pong.n}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
