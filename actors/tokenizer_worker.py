"""A tokenizer worker: tokenizes its callers' requests and answers them with their output.

One of N. It stamps each request with its ``origin`` (worker id and incarnation), forwards it
to the scheduler, receives from the detokenizer a sub-batch holding only its own requests,
and sends every caller its pieces — one message per caller per sub-batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio

from runtime import Actor, ActorRef, TokenyardError, handler

from ._tokenizer import load_tokenizer
from .messages import (
    Abort,
    AbortNotice,
    AbortRequest,
    BatchStrOutput,
    CheckFlush,
    CheckLoad,
    FlushCache,
    FlushReply,
    Generate,
    GetLoad,
    LoadReply,
    Origin,
    RegisterWorker,
    RequestOutput,
    RequestOutputs,
    TokenizedGenerate,
    Topology,
)

logger = logging.getLogger("tokenyard.worker")


@dataclass(slots=True)
class _Request:
    reply_to: ActorRef[Any]
    stream: bool
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


class TokenizerWorker(Actor):
    """Tokenizes requests, forwards them, streams their output back to their callers.

    Args:
        worker_id: Its index among the workers.
        supervisor: Where it registers; it serves only once registered.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled one).
        register_timeout: Seconds to get registered before it gives up (and dies, so its
            supervisor restarts it).
    """

    def __init__(
        self,
        worker_id: int,
        supervisor: ActorRef[Any],
        tokenizer: str | None = None,
        register_timeout: float = 10.0,
    ) -> None:
        self.worker_id = worker_id
        self.supervisor = supervisor
        self.tokenizer_path = tokenizer
        self.register_timeout = register_timeout
        self.tokenizer: Any = None
        self.origin = Origin(worker_id, 0)
        self.scheduler: ActorRef[Any] | None = None
        self.requests: dict[str, _Request] = {}
        self.registered = anyio.Event()
        #: Requests waiting for a (re)started scheduler, by rid.
        self.backlog: dict[str, TokenizedGenerate] = {}
        self.control: dict[int, ActorRef[Any]] = {}
        self._control_ids = itertools.count(1)

    async def on_start(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.origin = Origin(self.worker_id, self.ref.incarnation)
        self.start_soon(self._register)

    async def _register(self) -> None:
        msg = RegisterWorker(
            worker_id=self.worker_id, incarnation=self.ref.incarnation, address=self.ref
        )
        # An ask timing out here raises: the worker dies and its supervisor restarts it.
        await self.supervisor.ask(msg, timeout=self.register_timeout)
        self.registered.set()

    @handler
    async def topology(self, msg: Topology) -> None:
        """The supervisor says where the scheduler is now: send what waited for it."""
        self.scheduler = msg.scheduler
        if self.scheduler is not None and self.backlog:
            backlog, self.backlog = self.backlog, {}
            for request in backlog.values():
                await self._forward(request)

    # -- requests from callers ------------------------------------------------------------

    @handler
    async def generate(self, msg: Generate) -> None:
        """Tokenize a request and hand it to the scheduler."""
        await self.registered.wait()
        # A rid already here is a resubmission after the detokenizer or the scheduler died
        # (their requests were dropped): the new attempt replaces the old state.
        if msg.input_ids is not None:
            ids = list(msg.input_ids)
        elif msg.text is not None:
            ids = self.tokenizer.encode(msg.text, add_special_tokens=False).ids
        else:
            await self._fail(msg.reply_to, msg.rid, 0, "a request needs text or input_ids")
            return
        if not ids:
            await self._fail(msg.reply_to, msg.rid, 0, "the prompt tokenizes to nothing")
            return
        self.requests[msg.rid] = _Request(msg.reply_to, msg.stream, len(ids))
        await self._forward(
            TokenizedGenerate(rid=msg.rid, origin=self.origin, input_ids=ids, sampling=msg.sampling)
        )

    async def _forward(self, request: TokenizedGenerate) -> None:
        """Send to the scheduler; while it is down, keep the request for its successor."""
        if self.scheduler is not None:
            try:
                await self.scheduler.tell(request)
                return
            except TokenyardError as err:
                logger.info("%s: scheduler unreachable, holding requests: %s", self.ref.name, err)
                self.scheduler = None
        self.backlog[request.rid] = request

    @handler
    async def abort_request(self, msg: AbortRequest) -> None:
        """A caller gave up: stop generating for it."""
        if msg.rid in self.requests and self.scheduler is not None:
            try:
                await self.scheduler.tell(Abort(origin=self.origin, rid=msg.rid, reason="abort"))
            except TokenyardError:
                self.requests.pop(msg.rid, None)

    # -- output from the detokenizer ------------------------------------------------------

    @handler
    async def output(self, msg: BatchStrOutput) -> None:
        """This worker's share of one step: answer each caller with one message."""
        by_caller: dict[ActorRef[Any], list[RequestOutput]] = {}
        for i, rid in enumerate(msg.rids):
            request = self.requests.get(rid)
            if request is None:
                continue  # aborted meanwhile, or output for a request this incarnation lacks
            finish = msg.finished_reasons[i]
            piece, ids = msg.output_strs[i], msg.output_ids[i]
            if request.stream:
                out = RequestOutput(
                    rid=rid,
                    worker=self.worker_id,
                    text=piece,
                    output_ids=ids,
                    prompt_tokens=request.prompt_tokens,
                    completion_tokens=msg.completion_tokens[i],
                    finish_reason=finish,
                )
            else:
                request.text.append(piece)
                request.output_ids.extend(ids)
                if finish is None:
                    continue
                out = RequestOutput(
                    rid=rid,
                    worker=self.worker_id,
                    text="".join(request.text),
                    output_ids=request.output_ids,
                    prompt_tokens=request.prompt_tokens,
                    completion_tokens=msg.completion_tokens[i],
                    finish_reason=finish,
                )
            if finish is not None:
                del self.requests[rid]
            by_caller.setdefault(request.reply_to, []).append(out)
        for caller, outputs in by_caller.items():
            await self._send(caller, outputs)

    @handler
    async def aborted(self, msg: AbortNotice) -> None:
        """The scheduler refused or aborted a request on its own: tell its caller."""
        request = self.requests.pop(msg.rid, None)
        if request is not None:
            await self._fail(request.reply_to, msg.rid, request.prompt_tokens, msg.reason)

    # -- control requests whose replies come back through the router ----------------------

    @handler
    async def check_load(self, msg: CheckLoad) -> None:
        """Ask the scheduler for its load; the reply returns via the router."""
        await self._control(msg.reply_to, lambda rid: GetLoad(origin=self.origin, request_id=rid))

    @handler
    async def check_flush(self, msg: CheckFlush) -> None:
        """Ask the scheduler to flush; the reply returns via the router."""
        await self._control(
            msg.reply_to, lambda rid: FlushCache(origin=self.origin, request_id=rid)
        )

    async def _control(self, reply_to: ActorRef[Any], make: Any) -> None:
        await self.registered.wait()
        request_id = next(self._control_ids)
        self.control[request_id] = reply_to
        if self.scheduler is not None:
            try:
                await self.scheduler.tell(make(request_id))
            except TokenyardError:
                self.control.pop(request_id, None)

    @handler
    async def load_reply(self, msg: LoadReply) -> None:
        """The router brought back the scheduler's load."""
        await self._control_reply(msg)

    @handler
    async def flush_reply(self, msg: FlushReply) -> None:
        """The router brought back the flush result."""
        await self._control_reply(msg)

    async def _control_reply(self, msg: LoadReply | FlushReply) -> None:
        if msg.origin != self.origin:
            logger.error("%s got a control reply for %s", self.ref.name, msg.origin)
            return
        reply_to = self.control.pop(msg.request_id, None)
        if reply_to is not None:
            with contextlib.suppress(TokenyardError):  # the caller may have left
                await reply_to.tell(msg)

    # -- helpers --------------------------------------------------------------------------

    async def _fail(self, caller: ActorRef[Any], rid: str, prompt_tokens: int, error: str) -> None:
        out = RequestOutput(
            rid=rid,
            worker=self.worker_id,
            text="",
            output_ids=[],
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            finish_reason="abort",
            error=error,
        )
        await self._send(caller, [out])

    async def _send(self, caller: ActorRef[Any], outputs: list[RequestOutput]) -> None:
        try:
            await caller.tell(RequestOutputs(outputs=outputs))
        except TokenyardError as err:
            # The caller is gone: nobody waits for these; drop them.
            logger.debug("%s: caller %s unreachable: %s", self.ref.name, caller.name, err)
