"""The worker's end of the connection channel (`actors.http._connections`): every
connection it takes and every one that closes is told to the owner, in order, however
long the owner leaves the channel unread."""

from __future__ import annotations

import array
import itertools
import socket

import anyio

from actors.http._connections import CLOSED, MARKS_PER_MESSAGE, TAKEN, ConnectionServer


async def app(scope: object, receive: object, send: object) -> None:
    """No request reaches it: the connections close before sending one."""
    raise AssertionError("no request was sent")


async def test_marks_wait_while_the_owner_reads_nothing_and_none_is_lost() -> None:
    owner, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ConnectionServer(app, worker.detach())
    count = 1500  # several times what the channel holds unread, in marks of both kinds
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        clients = []
        for _ in range(count):
            client, served = socket.socketpair()
            fds = array.array("i", [served.fileno()]).tobytes()
            owner.sendmsg([b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            served.close()  # the worker holds its own copy now
            clients.append(client)
            await anyio.lowlevel.checkpoint()
        with anyio.fail_after(10):
            for _ in itertools.count():  # each taken and connected
                if server.served == count:
                    break
                await anyio.sleep(0.01)  # sync-ok: polling a counter
        for client in clients:
            client.close()  # each closes: a CLOSED mark each
        marks = bytearray()
        owner.setblocking(False)
        with anyio.fail_after(10):
            while marks.count(CLOSED) < count:
                await anyio.wait_readable(owner)
                marks += owner.recv(MARKS_PER_MESSAGE)
        server.close()
        tg.cancel_scope.cancel()
    owner.close()
    assert marks.count(TAKEN) == count
    assert marks.count(CLOSED) == count
    # In order: never more closed than taken at any point.
    taken = 0
    for mark in marks:
        taken += 1 if mark == TAKEN[0] else -1
        assert taken >= 0
