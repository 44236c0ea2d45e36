"""`VllmClient`: one tokenizer worker's own connection to vLLM's engine (`Vllm.direct`).

vLLM's engine takes several clients: its handshake lists one input and one output address
per client, it connects to all of them, and each request's ``client_index`` names the output
its results go to (vLLM's own API servers use this, one client each). The scheduler makes
the handshake (`actors._vllm_engine`) and names each worker's addresses after its own; the
worker binds them for the pipeline's life, so that a restarted worker binds them again and
the engine's sockets, which reconnect by themselves, find it.

- **Input**, a ROUTER: requests go out as ``[engine identity, type, body]``. The engine
  says nothing on it after its ready message, so a restarted worker cannot learn its
  identity: it is engine 0's (`ENGINE_IDENTITY`; the scheduler refuses another in direct
  mode). Until the engine has connected (at its start, or again after this worker's
  restart) a frame is not routable: it waits, and is sent once it is. A second peer
  claiming the identity is refused while the engine's connection lives (no handover: it
  would take the worker's traffic); ZeroMQ's heartbeats end a connection the engine left
  half-open, so that a new engine is taken. An engine that stays unreachable for
  ``unreachable_after`` seconds makes the worker fail what waits for it, and say so
  (`unreachable`) until a frame goes through; its log says so once an outage.
- **Output**, watched too: while the engine runs a request of this worker's and says
  nothing on it, it is asked whether it lives every ``heartbeat`` (a utility call of this
  client's, answered here); past ``silence_timeout`` the worker fails those requests and
  says why, until a frame comes.
- **Output**, a PULL: the engine's outputs for this worker's requests. A frame that does not
  decode is counted and logged (rate-limited), never raised.

The worker owns its requests; this client only sends, receives and bounds what it queues:
an ADD whose request was let go before it could be sent is never sent.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import msgspec
import zmq
import zmq.asyncio

from runtime import Throttle

from . import _vllm_protocol as proto
from ._vllm_engine import ENGINE_IDENTITY, abort_frames, bounded_socket, engine_request

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .engines import EngineClient
    from .messages import SamplingParams

__all__ = ("MAX_QUEUED", "VllmClient")

logger = logging.getLogger("tokenyard.vllm")

#: Most frames waiting to be sent (the engine not connected yet); past it `add` refuses.
MAX_QUEUED = 10_000

#: Seconds between two tries to send while the engine is not connected to this worker.
_RETRY = 0.02

#: Seconds between two probes of an engine that is unreachable.
_PROBE_EVERY = 2.0

#: ZeroMQ heartbeats on the input: a connection whose peer answers none for the timeout
#: (milliseconds) is closed.
_HEARTBEAT_IVL = 2_000
_HEARTBEAT_TIMEOUT = 10_000

#: Stray request ids (of an earlier incarnation) whose abort was sent, so that each step of
#: theirs does not send another; the oldest are forgotten past this many.
_MAX_STRAYS = 4_096

_ENCODER = msgspec.msgpack.Encoder()
_OUTPUTS = msgspec.msgpack.Decoder(proto.EngineCoreOutputs)


class VllmClient:
    """A worker's connection to vLLM's engine as its client ``client.index``.

    Args:
        client: The worker's addresses and client index.
        eos: The tokenizer's end-of-sequence id (sent as vLLM's front end sends it).
        on_outputs: Called, in this event loop, with each message's outputs.
        on_unreachable: Called with the reason and the ids of the requests given up when
            the engine stayed unreachable for ``unreachable_after`` seconds, or silent on
            the output for ``silence_timeout`` while it ran some.
    """

    def __init__(
        self,
        client: EngineClient,
        *,
        eos: int | None,
        on_outputs: Callable[[list[proto.EngineCoreOutput]], Awaitable[None]],
        on_unreachable: Callable[[str, list[str]], Awaitable[None]],
    ) -> None:
        self._client = client
        self._eos = eos
        self._on_outputs = on_outputs
        self._on_unreachable = on_unreachable
        self._ctx = zmq.asyncio.Context()
        self._input = bounded_socket(self._ctx, zmq.ROUTER, client.max_frame)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL)
        self._input.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT)
        self._output = bounded_socket(self._ctx, zmq.PULL, client.max_frame)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        #: Bumped by `forget`: a send that was waiting meanwhile belongs to the old queue.
        self._generation = 0
        #: Why the engine takes nothing from this worker (``None``: not known not to).
        self._input_down: str | None = None
        #: Why nothing reaches this worker from the engine (``None``: not known not to).
        self._output_down: str | None = None
        self._heard_at = time.monotonic()
        #: Frames to send, in order: ``(engine rid, frames)`` (``None``: not an ADD).
        self._queue: collections.deque[tuple[str | None, list[bytes]]] = collections.deque()
        self._queued = anyio.Event()
        #: ADDs queued and not sent yet; one let go meanwhile is left out of it.
        self._unsent: set[str] = set()
        #: Requests the engine has and has not ended.
        self._running: set[str] = set()
        self._strays: dict[str, None] = {}
        self._bad = Throttle(logger)
        #: Frames from the engine that did not decode.
        self.rejected_frames = 0
        #: Tries to send while the engine was not connected to this worker.
        self.unroutable = 0
        self._unroutable_since: float | None = None
        #: ``ENGINE_CORE_DEAD`` frames heard (the scheduler loses the engine and says so).
        self.death_frames = 0

    @property
    def unreachable(self) -> str | None:
        """Why the engine and this worker do not reach each other (``None``: they do, as
        far as is known)."""
        return self._input_down or self._output_down

    def add(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> bool:
        """Queue a request (``rid``: unique among every client's live requests); ``False``
        when `MAX_QUEUED` frames already wait (the engine has not connected)."""
        if len(self._queue) >= MAX_QUEUED:
            return False
        request = engine_request(rid, prompt_ids, sampling, self._eos, self._client.index)
        self._unsent.add(rid)
        self._push(rid, [proto.ADD, _ENCODER.encode(request)])
        return True

    def abort(self, rid: str) -> None:
        """Stop the engine generating for ``rid`` (nothing is sent if it never got it)."""
        if rid in self._unsent:
            self._unsent.discard(rid)
        elif rid in self._running:
            self._running.discard(rid)
            self._push(None, abort_frames(rid))

    def ended(self, rid: str) -> None:
        """The engine ended ``rid`` itself (its last output came)."""
        self._running.discard(rid)

    def abort_stray(self, rid: str) -> bool:
        """Abort a request this worker does not know (an earlier incarnation's, or one of
        an engine that was replaced), once; whether this call did."""
        if rid in self._strays or len(self._queue) >= MAX_QUEUED:
            return False
        self._strays[rid] = None
        if len(self._strays) > _MAX_STRAYS:
            del self._strays[next(iter(self._strays))]
        self._push(None, abort_frames(rid))
        return True

    def forget(self) -> None:
        """The engine was replaced (its scheduler died): nothing queued or running is kept,
        and nothing known of the old engine's reach (unreachable, silent) is said of the new
        one, which has not been tried yet."""
        self._drop_queue()
        self._running.clear()
        self._input_down = None
        self._output_down = None
        self._unroutable_since = None
        self._heard_at = time.monotonic()

    def _drop_queue(self) -> None:
        """Drop every frame waiting to be sent (a send waiting meanwhile is of the old
        queue: ``_generation`` says so)."""
        self._generation += 1
        self._queue.clear()
        self._unsent.clear()

    def _push(self, rid: str | None, frames: list[bytes]) -> None:
        self._queue.append((rid, frames))
        self._queued.set()

    async def run(self) -> None:
        """Bind both addresses and serve them until cancelled; then close the sockets."""
        try:
            self._input.bind(self._client.input)
            self._output.bind(self._client.output)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._deliver)
                tg.start_soon(self._drain_input)
                tg.start_soon(self._probe)
                await self._receive()
        finally:
            self._input.close(linger=0)
            self._output.close(linger=0)
            self._ctx.term()

    async def _deliver(self) -> None:
        """Send the queued frames in order, each once the engine is connected."""
        while True:
            while self._queue:
                item = self._queue[0]
                rid, frames = item
                if rid is not None and rid not in self._unsent:
                    self._queue.popleft()  # let go before it was sent
                    continue
                generation = self._generation
                try:
                    await self._input.send_multipart([ENGINE_IDENTITY, *frames])
                except zmq.ZMQError as err:
                    if err.errno != zmq.EHOSTUNREACH:
                        raise
                    await self._unroutable()
                    continue
                self._unroutable_since = None
                self._input_down = None
                if generation != self._generation:
                    continue  # forgotten while it was sent: the queue is another
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()
                if rid is None:
                    continue
                if rid in self._unsent:
                    self._unsent.discard(rid)
                    self._running.add(rid)
                else:  # let go while it was being sent: the engine has it, abort it
                    self._push(None, abort_frames(rid))
            self._queued = anyio.Event()
            await self._queued.wait()

    async def _unroutable(self) -> None:
        """The engine is not connected to this worker: wait a little, or, past
        ``unreachable_after``, give up on what waits for it."""
        self.unroutable += 1
        now = time.monotonic()
        if self._unroutable_since is None:
            self._unroutable_since = now
        waited = now - self._unroutable_since
        if waited < self._client.unreachable_after:
            # sync-ok: the engine connecting to this socket is not announced on it; the
            # frame is tried again until it is routable.
            await anyio.sleep(_RETRY)
            return
        reason = (
            f"vLLM's engine has not been connected to this worker's {self._client.input} "
            f"for {waited:.0f} s: is the address reachable from the engine's host "
            "(a port opened; serve --vllm-client-port)?"
        )
        if self._input_down is None:  # once an outage: its requests fail with the reason
            logger.error("%s", reason)
        self._input_down = reason
        dropped = sorted(self._unsent)
        self._drop_queue()
        self._unroutable_since = None
        await self._on_unreachable(reason, dropped)

    async def _probe(self) -> None:
        """Ask the engine whether it lives (a utility call of this client's, answered on
        this worker's output) while it is unreachable, or while it runs a request of this
        worker's and says nothing; past ``silence_timeout`` of that silence, fail what it
        ran for this worker: its outputs do not reach it."""
        client = self._client
        call = 0
        while True:
            # sync-ok: a periodic check of a connection nothing announces
            await anyio.sleep(min(_PROBE_EVERY, client.heartbeat / 2))
            now = time.monotonic()
            silent = now - self._heard_at
            if not self._running and self._output_down is None:
                self._heard_at = now  # nothing runs: silence is what is expected
                ask = self._input_down is not None
            elif silent > client.silence_timeout and self._output_down is None:
                reason = (
                    f"nothing from vLLM's engine on this worker's {client.output} for "
                    f"{silent:.0f} s although asked: is the address reachable from the "
                    "engine's host (a port opened; serve --vllm-client-port)?"
                )
                logger.error("%s", reason)
                running, dropped = sorted(self._running), sorted(self._running | self._unsent)
                self._drop_queue()
                self._running.clear()
                self._output_down = reason
                for rid in running:  # the engine may still take them, if not answer
                    self._push(None, abort_frames(rid))
                await self._on_unreachable(reason, dropped)
                ask = True
            else:
                ask = silent > client.heartbeat or self.unreachable is not None
            if ask and not self._queue:
                call += 1
                body = (client.index, call, "is_sleeping", ())
                self._push(None, [proto.UTILITY, _ENCODER.encode(body)])

    async def _drain_input(self) -> None:
        """Read what the engine says on the input socket (its ready message, at each of its
        starts) so that nothing piles up there."""
        while True:
            await anyio.lowlevel.checkpoint()  # as `_receive`: never a loop that holds it
            await self._input.recv_multipart()

    async def _receive(self) -> None:
        while True:
            # zmq.asyncio returns at once while frames wait, without suspending: an engine
            # that keeps sending would hold this loop, and the worker would answer nothing
            # else (asks, liveness probes, HTTP) until it paused. One turn per frame.
            await anyio.lowlevel.checkpoint()
            frames = await self._output.recv_multipart()
            self._heard_at = time.monotonic()
            self._output_down = None
            if frames[0] == proto.ENGINE_CORE_DEAD:
                self.death_frames += 1
                self._bad.warning("vLLM's engine sent ENGINE_CORE_DEAD (its log says why)")
                continue
            try:
                message = _OUTPUTS.decode(frames[0])
            except msgspec.MsgspecError as err:
                self.rejected_frames += 1
                self._bad.warning("a frame from vLLM on a worker's output socket: %s", err)
                continue
            if not message.outputs:
                continue
            try:
                await self._on_outputs(message.outputs)
            except Exception as err:  # noqa: BLE001 -- nothing the engine sends may end it
                self.rejected_frames += 1
                self._bad.error("outputs from vLLM the worker could not take", exc_info=err)
