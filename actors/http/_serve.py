"""``open_server``: the pipeline with every tokenizer worker serving HTTP on one port, and
``python -m actors serve``, its command line.

The process that runs it owns the listening socket (`Dispatcher`) and the pipeline's
supervisor; each worker process serves the OpenAI-compatible API (`HttpWorker`) on the
connections handed to it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from setproctitle import setproctitle

from actors._stop_signals import open_stop_signals
from actors._tokenizer import tokenizer_option_error
from actors._vllm_args import max_model_len, overridden
from actors.engines import LlamaCpp, StandIn, Vllm
from actors.messages import Drain, GetWorkerStatistics
from actors.pipeline import Pipeline
from runtime import ActorRef, SpawnError, TokenyardError, configure_logging, raise_fd_limit

from ._auth import API_KEY_ENV, ApiKey, key_given
from ._config import ServeConfig
from ._descriptors import connection_bounds, server_processes
from ._dispatch import Dispatcher, DispatchStatistics
from ._pipeline_engine import DEFAULT_CONTEXT_LENGTH
from ._worker import CUT_GRACE

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

__all__ = ("Server", "main", "open_server")

logger = logging.getLogger("tokenyard.http")

#: Seconds a worker has to say it drains.
DRAIN_ASK_TIMEOUT = 5.0

#: Why the requests still running are ended when a later drain (a second signal) brings
#: the end of the one under way forward: not for want of time, which the drain timeout
#: would give them.
CUT_SHORT = (
    "the server is shutting down: its drain was cut short (a second SIGTERM, SIGINT or "
    "SIGHUP, or Server.drain with less time) before the request finished"
)


class Server:
    """A running server: the pipeline behind it and the port's owner.

    Args:
        pipeline: The pipeline (its workers serve the HTTP).
        dispatcher: Who owns the port and hands out the connections.

    Attributes:
        pipeline: The pipeline (its workers serve the HTTP).
        dispatcher: Who owns the port and hands out the connections.
    """

    def __init__(self, pipeline: Pipeline, dispatcher: Dispatcher) -> None:
        self.pipeline = pipeline
        self.dispatcher = dispatcher
        #: When the drain under way ends the requests still running (``None``: none).
        self._cut_at: float | None = None
        #: Why the requests still running then are ended, as their answers say (empty: the
        #: drain timeout passed; `CUT_SHORT` once a later drain brought the moment forward).
        self._cut_reason = ""
        #: The first drain's wait for the connections to close: a later drain moves its
        #: deadline forward (``None``: not waiting).
        self._waiting: anyio.CancelScope | None = None
        #: Set when the first drain is over; `_clean` then says how it went.
        self._drained = anyio.Event()
        self._clean = False

    @property
    def url(self) -> str:
        """The base URL clients use (``http://host:port``)."""
        host, port = self.dispatcher.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def statistics(self) -> DispatchStatistics:
        """Connections accepted, and handed to each worker."""
        return self.dispatcher.statistics()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop taking connections and let the requests in flight finish (SIGTERM's way).

        The listener closes (new clients are refused), the connections accepted are still
        served one request each, and idle ones close. Requests still running ``timeout``
        seconds later are ended: a stream with an error event and ``data: [DONE]``, any
        other answer with 503. Calling it again, during a drain, can only bring that
        moment forward (a second Ctrl-C: ``drain(0)``); such a call returns what the drain
        under way returns.

        Args:
            timeout: Seconds the requests get (None: ``ServeConfig.drain_timeout``).

        Returns:
            Whether every request finished in time (nothing had to be ended, and no
            worker died while it served a connection).
        """
        if timeout is None:
            timeout = self.dispatcher.config.drain_timeout
        cut_at = anyio.current_time() + timeout
        if self._cut_at is not None:
            if cut_at >= self._cut_at:
                return False  # a drain under way ends sooner; it reports
            # Sooner: the first drain's wait ends then too, and it reports the cut.
            self._cut_at = cut_at
            self._cut_reason = CUT_SHORT
            if self._waiting is not None:
                self._waiting.deadline = cut_at
            await self._tell_workers(timeout)
            await self._drained.wait()
            return self._clean
        self._cut_at = cut_at
        dropped = self.dispatcher.dropped
        try:
            self.dispatcher.stop_listening()
            async with anyio.create_task_group() as tg:
                for k in range(self.pipeline.config.workers):
                    tg.start_soon(self._drain_successors, k)
                await self._tell_workers(timeout)
                with anyio.CancelScope(deadline=self._cut_at) as waiting:
                    self._waiting = waiting
                    await self.dispatcher.wait_idle()
                self._waiting = None
                # Not `waiting.cancelled_caught` alone: a loop that turns again only after
                # the deadline (no CPU for a while) sees the connections close before it
                # delivers the cancellation, and the wait ends with none to catch.
                self._clean = not waiting.cancelled_caught and anyio.current_time() < self._cut_at
                # Connections that closed with their channel before the deadline: their worker
                # died with them (a worker closes its own only at its cut, past the deadline).
                lost = self.dispatcher.dropped - dropped
                if not self._clean:
                    # The workers end what still runs; its last answers go out.
                    with anyio.move_on_after(CUT_GRACE + 1.0):
                        await self.dispatcher.wait_idle()
                    # Connections still open at the deadline may only have been closing
                    # (an idle keep-alive one, drained with no time given): clean if no
                    # worker ended a request.
                    self._clean = await self._none_cut()
                if lost:
                    self._clean = False
                    logger.warning(
                        "%d connection(s) closed with their worker, which died during the "
                        "drain: the requests on them ended unanswered",
                        lost,
                    )
                tg.cancel_scope.cancel()
            return self._clean
        finally:
            self._drained.set()

    async def _none_cut(self) -> bool:
        """Whether every worker answers that its drain ended no request (a worker that
        does not answer, or is missing, counts as having ended some)."""
        for k in range(self.pipeline.config.workers):
            ref = self.pipeline.worker_ref(k)
            if ref is None:
                return False
            try:
                stats = await ref.ask(GetWorkerStatistics(), timeout=DRAIN_ASK_TIMEOUT)
            except TokenyardError:
                return False
            if stats.cut:
                return False
        return True

    async def _tell_workers(self, timeout: float) -> None:
        """Tell every live worker to drain, its requests ending ``timeout`` s from now."""
        for k in range(self.pipeline.config.workers):
            ref = self.pipeline.worker_ref(k)
            if ref is not None:
                await self._tell_worker(k, ref, timeout)

    async def _tell_worker(self, k: int, ref: ActorRef[Any], timeout: float) -> None:
        drain = Drain(timeout=timeout, reason=self._cut_reason)
        try:
            await ref.ask(drain, timeout=DRAIN_ASK_TIMEOUT)
        except TokenyardError as err:  # dead or stuck: its death ends its requests
            logger.warning("worker %d was not told to drain: %s", k, err)

    async def _drain_successors(self, k: int) -> None:
        """Tell each incarnation of worker ``k`` that starts during the drain to drain, by
        the same deadline: the owner hands it what its predecessor had not taken, and what
        waited here, which it must serve one request each and cut at the deadline too
        (telling one that was told already changes nothing)."""
        ref = self.pipeline.worker_ref(k)
        after = 0 if ref is None else ref.incarnation
        while True:  # until the drain is over (it cancels this)
            assert self._cut_at is not None
            ref = await self.pipeline.wait_worker(k, after=after, timeout=math.inf)
            after = ref.incarnation
            await self._tell_worker(k, ref, max(self._cut_at - anyio.current_time(), 0.0))


def default_detokenizers(workers: int) -> int:
    """One detokenizer per two workers: with one, the detokenizer became the busiest process
    at 4 workers (the serve benchmark, docs/benchmarks.md)."""
    return max(1, workers // 2)


@contextlib.asynccontextmanager
async def open_server(
    workers: int = 4,
    tokenizer: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    detokenizers: int | None = None,
    config: ServeConfig | None = None,
    model: str | None = None,
    context_length: int | None = None,
    credentials: str | os.PathLike[str] | None = None,
    **pipeline: Any,
) -> AsyncIterator[Server]:
    """Start the pipeline with its workers serving the OpenAI API on ``host:port``.

    Args:
        workers: Tokenizer workers, each serving HTTP in its own process.
        tokenizer: A ``tokenizer.json`` (None: the bundled one).
        host: The interface to listen on.
        port: The port (0: any free one; `Server.url` says which).
        detokenizers: Detokenizer processes (None: `default_detokenizers`, one per two
            workers).
        config: The HTTP layer's limits.
        model: The model id (None: derived from the tokenizer).
        context_length: Most prompt plus completion tokens of one request.
        credentials: Where to write the pipeline system's credentials (mode 0600, removed
            when the system closes; `runtime.ActorSystem.save_credentials`), before any
            client is answered.
        **pipeline: Other `actors.Pipeline` arguments (``step_time``, limits, ...).

    Yields:
        The server, once every worker serves: no client is answered before (a
        connection waits in the listen backlog).

    The open-file limit bounds the connections each process holds (a worker's
    ``max_connections`` may be lowered, with one warning;
    `actors.http._descriptors.connection_bounds`).
    """
    config = config or ServeConfig()
    if detokenizers is None:
        detokenizers = default_detokenizers(workers)
    # The limit every process of the server will have: each takes its hard one.
    raise_fd_limit()
    bounds = connection_bounds(config, workers, detokenizers)
    lowered = bounds.lowered(config, workers)
    if lowered is not None:
        logger.warning("%s", lowered)
    if bounds.max_connections < config.max_connections:
        config = msgspec.structs.replace(config, max_connections=bounds.max_connections)
    dispatcher = Dispatcher(
        host,
        port,
        config=config,
        model=model,
        context_length=context_length,
        max_stream_buffer=pipeline.get("max_stream_buffer", 4 << 20),
        hold=bounds.hold,
    )
    try:
        async with Pipeline(
            workers,
            tokenizer,
            detokenizers=detokenizers,
            channels=dispatcher,
            model=model,
            **pipeline,
        ) as p:
            if credentials is not None:
                p.system.save_credentials(credentials, collector=p.collector)
            dispatcher.release()
            yield Server(p, dispatcher)
    finally:
        dispatcher.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m actors serve",
        description="the OpenAI-compatible server: every tokenizer worker serves HTTP on one port",
    )
    parser.add_argument("--workers", type=int, default=4, help="tokenizer workers (default 4)")
    parser.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--tokenizer", help="a tokenizer.json, or a directory holding one")
    parser.add_argument(
        "--detokenizers", type=int, default=None, help="detokenizers (default: one per two workers)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=20,
        metavar="N",
        help="give up (exit 1) past N restarts of the pipeline's members within "
        "--restart-period (default %(default)s)",
    )
    parser.add_argument(
        "--restart-period",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds over which --max-restarts counts (default %(default)s)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id in /v1/models and every answer (default: from the tokenizer)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine",
        choices=("stand-in", "llamacpp", "vllm"),
        default="stand-in",
        help="what generates: the stand-in (deterministic fake tokens, no model: front-end "
        "benchmarks), llama.cpp in-process on --model (the llamacpp extra), or vLLM's "
        "engine core, attached (--engine-handshake) or launched (--model) (default stand-in)",
    )
    engine.add_argument(
        "--model",
        metavar="PATH",
        help="llamacpp: a GGUF file, or a directory holding model.gguf (python -m actors "
        "make-model DIR writes one); vllm: launch an engine on this model directory "
        "(python -m actors make-hf-model DIR writes one), more vllm serve arguments after "
        "--. Its tokenizer.json is then the default --tokenizer",
    )
    engine.add_argument(
        "--engine-handshake",
        metavar="tcp://HOST:PORT",
        help="vllm: attach to an engine started elsewhere with vllm serve MODEL --headless "
        "--skip-tokenizer-init --data-parallel-address HOST --data-parallel-rpc-port PORT",
    )
    engine.add_argument(
        "--vllm-python",
        metavar="PATH",
        default="",
        help="vllm, launched: the Python of the venv vLLM is installed in (default "
        "$TOKENYARD_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    vllm_defaults = Vllm(model="")
    engine.add_argument(
        "--vllm-clients",
        choices=("workers", "scheduler"),
        default="workers",
        help="vllm: who is the engine's client: each worker, sending its requests and "
        "detokenizing their outputs itself (default), or the scheduler alone, every request "
        "going through it and a detokenizer",
    )
    engine.add_argument(
        "--vllm-client-port",
        type=int,
        default=vllm_defaults.client_port,
        metavar="PORT",
        help="vllm, attached, --vllm-clients workers: the first of the ports the workers bind "
        "for the engine, two each (default: a block free at the start, below the system's "
        "ephemeral port range)",
    )
    engine.add_argument(
        "--vllm-unreachable-after",
        type=float,
        default=vllm_defaults.unreachable_after,
        metavar="S",
        help="vllm, --vllm-clients workers: seconds a worker's requests wait for the engine to "
        "connect to it before they fail (default %(default)s)",
    )
    engine.add_argument(
        "--vllm-max-frame",
        type=int,
        default=vllm_defaults.max_frame,
        metavar="BYTES",
        help="vllm: the largest frame a socket takes from the engine; a larger one ends its "
        "connection unread and its outputs are lost (default %(default)s: a step of over "
        "13,000 requests; each socket holds at most 64 frames)",
    )
    engine.add_argument(
        "--engine-start-tries",
        type=int,
        default=3,
        metavar="N",
        help="give up (exit 1) when the engine was never ready in N starts in a row, each "
        "ending in the scheduler's death or its failed restart (a launched engine that exits "
        "at start: a wrong vllm serve argument, a model that does not load) (default 3)",
    )
    defaults = LlamaCpp(model="")
    engine.add_argument(
        "--n-parallel",
        type=int,
        default=defaults.n_parallel,
        metavar="N",
        help=f"llamacpp: requests generated together (default {defaults.n_parallel})",
    )
    engine.add_argument(
        "--engine-context",
        type=int,
        default=defaults.context_length,
        metavar="N",
        help="llamacpp: prompt plus completion tokens of one request "
        f"(default {defaults.context_length})",
    )
    engine.add_argument(
        "--engine-threads",
        type=int,
        default=defaults.threads,
        metavar="N",
        help=f"llamacpp: CPU threads llama.cpp computes with (default {defaults.threads})",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds per step (one token per request) of the stand-in engine. The default, "
        "0, leaves no pause between steps: a whole reply is generated at once, and a streaming "
        "client gets it in one chunk or a few. --step-time 0.02 (20 ms a token) streams "
        "token by token, as a real model does",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default WARNING)",
    )
    parser.add_argument(
        "--credentials",
        metavar="PATH",
        help="write the system's credentials here (mode 0600, removed when the server ends, "
        "however it ends), for "
        "`python -m runtime top --credentials PATH`",
    )
    _add_config_arguments(parser.add_argument_group("limits and timeouts (ServeConfig)"))
    _add_access_arguments(parser)
    return parser


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call the server, from which web pages, and how answers name requests."""
    defaults = ServeConfig()
    access = parser.add_argument_group("access")
    access.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health (default: "
        f"${API_KEY_ENV}, else no key); prefer the variable, which `ps` does not show",
    )
    access.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of ORIGIN (scheme://host[:port], or '*' for any) call the "
        "server; repeat for more (default: none, CORS off)",
    )
    access.add_argument(
        "--max-request-id-length",
        type=int,
        default=defaults.max_request_id_length,
        metavar="N",
        help="longest X-Request-Id echoed; a longer one is replaced (default "
        f"{defaults.max_request_id_length})",
    )


def _access_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `ServeConfig` settings of `_add_access_arguments`'s flags.

    Raises:
        ValueError: A setting is refused (an empty key, say); the message names it.
    """
    key = key_given(args.api_key, "serve without a key")
    return {
        "api_key": None if key is None else ApiKey(key),
        "cors_origins": tuple(args.cors_origin),
        "max_request_id_length": args.max_request_id_length,
    }


#: `ServeConfig` fields the command line sets otherwise (`_add_access_arguments`), or not
#: at all.
_NOT_FLAGS = frozenset(
    {"model_id", "context_length", "api_key", "cors_origins", "max_request_id_length"}
)


def _add_config_arguments(group: argparse._ArgumentGroup) -> None:
    """One flag per `ServeConfig` field (``max_body_bytes`` is ``--max-body-bytes``), its
    help and default from the struct itself: a field added there is a flag here."""
    helps = _attribute_docs(ServeConfig.__doc__ or "")
    defaults = ServeConfig()
    for field in msgspec.structs.fields(ServeConfig):
        if field.name in _NOT_FLAGS:
            continue
        default = getattr(defaults, field.name)
        kind = float if isinstance(default, float) else int
        text = helps.get(field.name, "").replace("``", "").replace("%", "%%")
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=kind,
            default=None,
            metavar="S" if kind is float else "N",
            help=text if default is None else f"{text} (default {default})",
        )


def _attribute_docs(doc: str) -> dict[str, str]:
    """Each attribute's text in a Google-style docstring's ``Attributes:`` section."""
    docs: dict[str, str] = {}
    name = None
    inside = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        head, colon, rest = stripped.partition(":")
        if indent <= 8 and colon and head.isidentifier():
            name = head
            docs[name] = rest.strip()
        elif name is not None and indent > 8:
            docs[name] += " " + stripped
        else:
            break
    return docs


def _config(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` the flags ask for (the struct's defaults for the others).

    Raises:
        ValueError: A value the struct refuses (its message names the field).
    """
    given = {
        f.name: getattr(args, f.name)
        for f in msgspec.structs.fields(ServeConfig)
        if f.name not in _NOT_FLAGS and getattr(args, f.name) is not None
    }
    return ServeConfig(**given, **_access_config(args))


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline's engine, from ``--engine`` and its options (already checked)."""
    if args.engine == "stand-in":
        return {"step_time": args.step_time}
    if args.engine == "vllm":
        vllm = Vllm(
            handshake=args.engine_handshake,
            model=args.model,
            args=tuple(args.vllm_args),
            python=args.vllm_python,
            direct=args.vllm_clients == "workers",
            client_port=args.vllm_client_port,
            unreachable_after=args.vllm_unreachable_after,
            max_frame=args.vllm_max_frame,
        )
        # Checked by `_check_vllm`; the engine's own, once it is ready, may be shorter.
        return {"engine": vllm, "context_length": max_model_len(args.vllm_args)}
    spec = LlamaCpp(
        model=args.model,
        n_parallel=args.n_parallel,
        context_length=args.engine_context,
        threads=args.engine_threads,
    )
    return {"engine": spec, "context_length": spec.context_length}


def _check_vllm(args: argparse.Namespace) -> str | None:
    """Why ``--engine vllm``'s options cannot serve, or ``None``; resolves the tokenizer."""
    from actors._vllm_engine import resolve_python

    if (args.engine_handshake is None) == (args.model is None):
        return (
            "--engine vllm needs --engine-handshake tcp://HOST:PORT (attach to an engine "
            "started elsewhere) or --model DIR (launch one), not both"
        )
    try:
        Vllm(model="", max_frame=args.vllm_max_frame)
    except ValueError as err:
        return f"bad --vllm-max-frame: {err}"
    if args.engine_handshake is not None:
        if args.vllm_args:
            return (
                "vLLM arguments after -- are for a launched engine (--model); give them to "
                "the engine you start"
            )
        try:
            Vllm(handshake=args.engine_handshake, client_port=args.vllm_client_port)
        except ValueError as err:
            return f"bad --engine-handshake or --vllm-client-port: {err}"
        return None
    try:
        max_model_len(args.vllm_args)
    except ValueError as err:
        return str(err)
    problem = overridden(args.vllm_args)
    if problem is not None:
        return problem
    path = Path(args.model)
    if not (path / "config.json").is_file():
        return (
            f"bad --model: {path} holds no config.json (a model directory; python -m actors "
            "make-hf-model DIR writes one)"
        )
    if args.tokenizer is None and (path / "tokenizer.json").is_file():
        args.tokenizer = str(path)
    try:
        resolve_python(Vllm(model=args.model, python=args.vllm_python))
    except FileNotFoundError as err:
        return str(err)
    return None


def _check_engine(args: argparse.Namespace) -> str | None:
    """Resolve ``--model`` (a GGUF, or a directory holding one and its tokenizer) in
    ``args``; why the engine options cannot serve, or ``None``."""
    if args.engine != "vllm" and (args.engine_handshake is not None or args.vllm_args):
        return "--engine-handshake and vLLM arguments after -- are for --engine vllm"
    if args.engine_start_tries < 1:
        return "--engine-start-tries must be at least 1"
    if args.max_restarts < 0:
        return f"--max-restarts {args.max_restarts}: it must be at least 0"
    if not (math.isfinite(args.restart_period) and args.restart_period > 0):
        return f"--restart-period {args.restart_period:g}: it must be a number of seconds above 0"
    if args.engine == "stand-in":
        if args.model is not None:
            return "--model is for --engine llamacpp or vllm (the stand-in has no model)"
        try:
            StandIn(step_time=args.step_time)
        except ValueError as err:
            return f"--step-time: {err}"
        return None
    if args.step_time:
        return f"--step-time is the stand-in's; --engine {args.engine} takes its own pace"
    if args.engine == "vllm":
        return _check_vllm(args)
    if args.model is None:
        return f"--engine {args.engine} needs --model (a GGUF; python -m actors make-model DIR)"
    path = Path(args.model)
    if path.is_dir():
        if args.tokenizer is None and (path / "tokenizer.json").is_file():
            args.tokenizer = str(path)
        path = path / "model.gguf"
    args.model = str(path)
    problem = check_gguf(path)
    if problem is not None:
        return problem
    # A context holds a prompt token and a generated one at the least.
    for name, least in (("n_parallel", 1), ("engine_context", 2), ("engine_threads", 1)):
        if getattr(args, name) < least:
            return f"--{name.replace('_', '-')} must be at least {least}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and args.engine_threads > cpus:
        return (
            f"--engine-threads {args.engine_threads} is more than the {cpus} CPUs this process "
            "may run on: llama.cpp's threads would wait on each other (give at most that)"
        )
    return None


def check_gguf(path: Path) -> str | None:
    """Why ``path`` is not a GGUF llama.cpp can be given, or ``None`` (told before any
    process starts, not as the scheduler's failure to start)."""
    if not path.is_file():
        return f"bad --model: {path} does not exist (python -m actors make-model DIR writes one)"
    try:
        with path.open("rb") as gguf:
            magic = gguf.read(4)
    except OSError as err:
        return f"bad --model: {path} cannot be read ({err})"
    if magic != b"GGUF":
        return f"bad --model: {path} is not a GGUF file (it does not start with GGUF)"
    return None


def check_port(port: int) -> str | None:
    """Why ``--port`` cannot be listened on, or ``None``."""
    if not 0 <= port <= 65535:
        return f"--port {port}: a TCP port is 0 (any free one) to 65535"
    return None


#: Descriptors the serving process holds whatever the number of its processes (the
#: listener, libzmq's own, the system's mailboxes, the guardian's pipe), and those each
#: process it starts costs it (its pidfd and stdin, its connection to this process's
#: mailboxes and this process's to its own, a worker's channel). Measured at rest: 68 with
#: 2 workers and 1 detokenizer, 150 with 8 and 4 (about 23, and 9 a process); these leave
#: a third more, for the connections that wait in it.
FDS_AT_REST = 32
FDS_PER_PROCESS = 12


def check_fd_limit(
    workers: int,
    detokenizers: int,
    *,
    clients: int = 0,
    fewer: str = "serve fewer --workers or --detokenizers",
) -> str | None:
    """Why the open-file limit is too low for the processes of this pipeline, or ``None``.

    The serving process takes its hard ``RLIMIT_NOFILE`` as its soft one; below what its
    members' connections take, libzmq aborts it during the start (``Too many open files
    (src/ipc_listener.cpp:297)``, with no word of which limit). Checked by ``serve`` and
    the main job before anything starts.

    Args:
        workers: Tokenizer workers.
        detokenizers: Detokenizers.
        clients: HTTP clients the process runs besides (the main job's load), a
            descriptor each.
        fewer: The knobs that ask for fewer descriptors, as the line ends.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FDS_AT_REST + FDS_PER_PROCESS * server_processes(workers, detokenizers) + clients
    if hard == resource.RLIM_INFINITY or hard >= needed:
        return None
    members = (_count(workers, "worker"), _count(detokenizers, "detokenizer"))
    if clients:
        what = f"{members[0]}, {members[1]} and {_count(clients, 'HTTP client')}"
    else:
        what = f"{members[0]} and {members[1]}"
    return (
        f"the open-file limit (RLIMIT_NOFILE) is {hard}, and {what} need at least {needed} "
        f"in this process: raise it (ulimit -n {needed}, or LimitNOFILE= under systemd), or "
        f"{fewer}"
    )


def _check_credentials(path: str | None) -> str | None:
    """Why ``--credentials`` cannot be written, or ``None`` (checked before anything starts;
    the file itself is written once the server is up)."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        return f"--credentials {path}: a directory; name a file in it"
    if not target.parent.is_dir():
        return f"--credentials {path}: no directory {target.parent}"
    return None


async def _serve(args: argparse.Namespace, config: ServeConfig) -> int:
    # Open before the server starts and kept until the end: a signal during the start
    # cancels it (what had started stops; nothing was served), one after it drains.
    # A signal held since `python -m actors` began to import arrives first.
    with open_stop_signals() as signals:
        interrupted: list[int] = []
        failed = ""
        async with anyio.create_task_group() as tg:
            watching = anyio.CancelScope()

            async def stop_the_start() -> None:
                with watching:
                    async for signum in signals:
                        interrupted.append(signum)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_the_start)
            started = False
            try:
                async with open_server(
                    args.workers,
                    args.tokenizer,
                    host=args.host,
                    port=args.port,
                    detokenizers=args.detokenizers,
                    config=config,
                    model=args.served_model_name,
                    engine_start_tries=args.engine_start_tries,
                    max_restarts=args.max_restarts,
                    period=args.restart_period,
                    credentials=args.credentials or None,
                    **_engine_options(args),
                ) as server:
                    started = True
                    # From here a signal drains: the watch, cancelled while it waits,
                    # leaves the next signal to `_until_drained`.
                    watching.cancel()
                    keyed = ", API key required" if config.api_key is not None else ""
                    announce(
                        f"serving {server.url} with {_count(args.workers, 'worker')} and "
                        f"{_count(args.detokenizers, 'detokenizer')}{keyed}; Ctrl-C or "
                        "SIGTERM drains and stops\n"
                    )
                    return await _until_drained(server, signals)
            except OSError as err:
                if started:
                    raise
                failed = cannot_serve(args.host, args.port, err)
            except TokenyardError as err:
                # A member that failed to start (a SpawnError), or the system that could
                # not open (a temporary directory too long for its ipc sockets, say).
                if started:
                    raise
                failed = f"the pipeline did not start: {first_failure(err)}"
            watching.cancel()
    if interrupted:  # the start was cancelled, as asked; nothing was in flight
        name = signal.Signals(interrupted[0]).name
        logger.warning("%s while starting: stopped before serving anything", name)
        return 0
    # The log lines of this process before it, which a thread writes, come first.
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.write(failed + "\n")
    return 1


async def _until_drained(server: Server, signals: AsyncIterator[int]) -> int:
    """Serve until a signal, then drain; a signal during the drain ends what still runs
    at once. 0 after a clean drain, else 1; 1 at once when the pipeline fails (it serves
    nothing more: its supervisor gave up)."""
    failure: list[str] = []
    async with anyio.create_task_group() as tg:

        async def watch_pipeline() -> None:
            failure.append(await server.pipeline.until_failed())
            tg.cancel_scope.cancel()

        tg.start_soon(watch_pipeline)
        async for signum in signals:
            logger.warning(
                "%s: draining (new connections refused; requests in flight have %g s to finish)",
                signal.Signals(signum).name,
                server.dispatcher.config.drain_timeout,
            )
            break
        tg.cancel_scope.cancel()
    if failure:
        logger.error("the pipeline failed, nothing more is served: %s", failure[0])
        return 1
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:

        async def drain() -> None:
            drained.append(await server.drain())
            tg.cancel_scope.cancel()

        tg.start_soon(drain)
        async for signum in signals:
            logger.warning(
                "%s again: ending the requests in flight now", signal.Signals(signum).name
            )
            tg.start_soon(server.drain, 0.0)
    return 0 if drained and drained[0] else 1


def open_standard_streams() -> None:
    """Open the null device on each of descriptors 0, 1 and 2 that is closed (``serve
    >&-``, a daemon's leftovers). Otherwise the next descriptor opened takes its number (a
    socket of the system, say), and every process started from here on would have that
    as its standard output."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _null_device_on(fd)


def announce(line: str) -> None:
    """Write ``line`` on standard output, for whoever reads it: the server serves the same
    whether anyone does or not. Output that is closed, or a pipe whose reader left (``serve
    | head -c 1``), is pointed at the null device, so that nothing written later (Python's
    own flush at exit) fails again."""
    if sys.stdout is None:  # closed when Python started
        return
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except OSError:
        _null_device_on(sys.stdout.fileno())


def _null_device_on(fd: int) -> None:
    """Open the null device as descriptor ``fd`` (closing what ``fd`` was)."""
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:  # ``fd`` already, when it was the lowest descriptor closed
        os.dup2(null, fd)
        os.close(null)


def _count(n: int, what: str) -> str:
    """``"1 worker"``, ``"2 workers"``."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def first_failure(err: TokenyardError) -> str:
    """The first line of the failure that the others follow from (a member's spawn
    failure, under the pipeline supervisor's): what went wrong, without the tracebacks of
    every level (the member's own log has its traceback)."""
    while isinstance(err.__cause__, SpawnError):
        err = err.__cause__
    return str(err).partition("\n")[0]


def cannot_serve(host: str, port: int, err: OSError) -> str:
    """The one line that says why the server could not start, and what to change."""
    reason = (err.strerror or str(err)).lower()
    if err.errno == errno.EADDRINUSE:
        hint = " (another server? pick another --port)"
    elif err.errno == errno.EACCES:
        hint = " (a port below 1024 needs privileges: pick another --port)"
    elif err.errno == errno.EADDRNOTAVAIL or isinstance(err, socket.gaierror):
        hint = " (is --host an address of this machine?)"
    else:
        hint = ""
    return f"cannot serve on {host}:{port}: {reason}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m actors serve``: serve until SIGINT, SIGTERM or SIGHUP, then drain.

    A problem found before anything starts is one line on standard error: a bad argument
    (exit 2; a ``--tokenizer`` that does not load is one, found before any process starts)
    or a port it cannot listen on (exit 1).

    Returns:
        0 after a drain in which every request finished; 1 when some had to be ended, or
        the server could not start; 2 for bad arguments.
    """
    open_standard_streams()
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # What follows -- goes to `vllm serve`, untouched.
    split = given.index("--") if "--" in given else len(given)
    args = parser.parse_args(given[:split])
    args.vllm_args = given[split + 1 :]
    if args.detokenizers is None and args.workers >= 1:
        args.detokenizers = default_detokenizers(args.workers)
    if args.workers < 1 or args.detokenizers < 1:
        sys.stderr.write("--workers and --detokenizers must be at least 1\n")
        return 2
    problem = (
        _check_engine(args)
        or tokenizer_option_error(args.tokenizer)
        or check_port(args.port)
        or _check_credentials(args.credentials)
    )
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 2
    short = check_fd_limit(args.workers, args.detokenizers)
    if short is not None:  # not an argument's fault: the environment's, as a busy port
        sys.stderr.write(short + "\n")
        return 1
    try:
        config = _config(args)
        if args.engine == "stand-in":  # its context is known now; another engine's at start
            config.limits(DEFAULT_CONTEXT_LENGTH)
    except ValueError as err:
        sys.stderr.write(f"python -m actors serve: {err}\n")
        return 2
    if args.api_key is not None:
        # The key was on the command line, which every user of the host can read in
        # /proc/<pid>/cmdline: the process's title replaces it from here on.
        setproctitle(f"tokenyard::serve:{os.getpid()}")
    configure_logging(args.log_level, "serve")
    return anyio.run(_serve, args, config)
