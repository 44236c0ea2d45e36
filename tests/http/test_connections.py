"""The worker's end of the connection channel (`actors.http._connections`): every
connection it takes and every one that closes is told to the owner, in order, however
long the owner leaves the channel unread."""

from __future__ import annotations

import array
import asyncio
import itertools
import os
import resource
import socket
from typing import TYPE_CHECKING, Any

import anyio
from uvicorn.protocols.websockets import auto

from actors.http._connections import CLOSED, MARKS_PER_MESSAGE, TAKEN, ConnectionServer

if TYPE_CHECKING:
    import pytest


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


class _AWebSocketLibrary(asyncio.Protocol):
    """What uvicorn's websocket protocol does with a connection it is handed, as far as
    the worker's counts go: it takes the transport over, and closes it."""

    def __init__(self, **uvicorns: Any) -> None:
        super().__init__()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


async def health(scope: dict[str, Any], receive: object, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def test_a_websocket_upgrade_is_an_http_request_told_closed_like_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a websocket library installed (uvicorn's ``ws="auto"`` finds one), an
    ``Upgrade: websocket`` request handed its connection to that library's protocol: the
    bounds were gone, and its close was never told to the owner, whose count of what the
    worker serves grew for good (a client could fill it, and a drain waited for it)."""
    monkeypatch.setattr(auto, "AutoWebSocketsProtocol", _AWebSocketLibrary)
    owner, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ConnectionServer(health, worker.detach())
    client, served = socket.socketpair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        fds = array.array("i", [served.fileno()]).tobytes()
        owner.sendmsg([b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        served.close()
        client.sendall(
            b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        client.setblocking(False)
        with anyio.fail_after(10):
            await anyio.wait_readable(client)
            answer = client.recv(65536)
        client.close()
        marks = bytearray()
        owner.setblocking(False)
        with anyio.fail_after(10):
            while CLOSED not in marks:
                await anyio.wait_readable(owner)
                marks += owner.recv(MARKS_PER_MESSAGE)
        server.close()
        tg.cancel_scope.cancel()
    owner.close()
    assert answer.startswith(b"HTTP/1.1 204"), answer
    assert server.open == 0


async def test_a_connection_lost_for_want_of_a_descriptor_is_told_taken() -> None:
    """Out of descriptors, the kernel drops a connection handed to the worker. Before, the
    worker said nothing of it: the owner kept its own copy as untaken, paired the worker's
    next TAKEN with the wrong connection, and at last reported a live worker stuck (and
    handed a connection that worker served to another)."""
    owner, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ConnectionServer(app, worker.detach())
    client, served = socket.socketpair()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    marks = bytearray()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        await anyio.lowlevel.checkpoint()
        fds = array.array("i", [served.fileno()]).tobytes()
        # No descriptor left below the limit: the one handed over cannot be received.
        spare = os.dup(0)
        os.close(spare)
        resource.setrlimit(resource.RLIMIT_NOFILE, (spare, hard))
        try:
            owner.sendmsg([b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            owner.setblocking(False)
            with anyio.fail_after(5):
                while len(marks) < 2:
                    await anyio.wait_readable(owner)
                    marks += owner.recv(MARKS_PER_MESSAGE)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            server.close()
            tg.cancel_scope.cancel()
    for sock in (owner, client, served):
        sock.close()
    assert marks == TAKEN + CLOSED
    assert server.open == 0
