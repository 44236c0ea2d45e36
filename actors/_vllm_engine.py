"""`VllmModel`: vLLM's engine core as the scheduler's `actors.engines.Generator`.

The scheduler's process is the engine's client 0 (`actors._vllm_protocol` has the
protocol): it binds the handshake, input and output sockets, and one task of its event loop
does all the socket work. ``admit`` and ``cancel`` only queue frames for that task, and
what the engine sends lands in per-request buffers that ``take`` empties, as llama.cpp's
threads fill theirs (`actors._llamacpp_engine`).

With `actors.engines.Vllm.direct` the tokenizer workers are the engine's clients 1 and up
(`actors._vllm_client`): the handshake names their addresses after the scheduler's, and
the scheduler's own client carries no request, only the heartbeat; it still launches the
engine, and the engine's loss is still the scheduler's death.

- **Until the engine is ready** its capacity is 0: the scheduler admits nothing, and its
  queue holds what arrives. Once the engine's `ReadyResponse` came, the capacity is its
  ``max_num_seqs``. A request is sent as vLLM's own front end sends it: its prompt ids and
  the sampling parameters with the tokenizer's eos filled in, each output holding only the
  new ids (DELTA). The engine applies stop ids, eos and ``max_tokens`` itself; so does the
  scheduler, whatever the engine does.
- **An abort** is sent as ABORT and forgotten at once: the engine sends nothing more for a
  request its client aborted (no finish), and whatever it sent before the abort reached it
  is dropped here.
- **A lost engine** (it sent ``ENGINE_CORE_DEAD``, its connection closed, its launched
  process exited, or it was silent past ``silence_timeout`` although asked whether it
  lives every ``heartbeat``) makes every call of the generator raise `EngineLostError`:
  the scheduler's step loop fails with it and its process ends. Its supervisor restarts
  it, and the pipeline does what it does for any scheduler death: requests that had
  streamed output fail, the others are resubmitted to the new incarnation, whose new
  generator launches a new engine, or waits for one to dial in (an engine takes one
  handshake per start: the old one cannot be reused).
- **Launched** (`actors.engines.Vllm` ``model=``), the engine is
  ``actors/_vllm_cli.py`` run by vLLM's venv's Python, in a process group of its own,
  holding the read end of a pipe whose write end only this process holds: when this
  process ends, however it ends, the launcher kills its group (vLLM's engine core and
  workers with it) and removes the ``/dev/shm`` files they had mapped and the private
  directory of vLLM's ipc sockets (its ``VLLM_RPC_BASE_PATH``, unless set). `aclose` ends the
  group itself: SIGTERM (vLLM's clean shutdown), then SIGKILL after ``_STOP_GRACE``
  seconds, by its id.

Nothing the engine sends can end the scheduler but through `EngineLostError`: a frame that
does not decode is counted and logged (rate-limited), an output for a request that is not
running is dropped, and the sockets bound what they hold (high-water marks and a maximum
message size).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from runtime import Throttle, TokenyardError

from . import _vllm_protocol as proto
from ._tokenizer import eos_token_id, outside_vocabulary, vocab_size
from .engines import Produced

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from .engines import Vllm
    from .messages import SamplingParams

__all__ = (
    "ENGINE_IDENTITY",
    "EngineLostError",
    "VllmModel",
    "bounded_socket",
    "engine_command",
    "engine_request",
    "open_vllm",
    "process_tree",
    "shared_memory_of",
    "step_bytes",
)

logger = logging.getLogger("tokenyard.vllm")

#: The launcher, run by path with vLLM's venv's Python.
CLI = Path(__file__).with_name("_vllm_cli.py")

#: The variable that names vLLM's venv's Python, when `Vllm.python` does not.
PYTHON_ENV = "TOKENYARD_VLLM_PYTHON"

#: Seconds a launched engine has to stop after SIGTERM before its group is killed.
_STOP_GRACE = 10.0

#: Bytes of one request's output in a step at most, as vLLM 0.32 writes it: its first
#: (its events and prefill statistics, a rid of 40 characters, the ids of a speculative
#: step) takes under 300, the next ones about 60; and of the engine's statistics, which
#: one frame a step carries, about 600 (4 KiB allowed): what a step of ``max_num_seqs``
#: requests may take, compared with `actors.engines.Vllm.max_frame`.
_OUTPUT_BYTES = 320
_STATS_BYTES = 4 << 10

#: Frames each socket queues to send (ours, bounded before they are queued).
_SNDHWM = 10_000

#: Frames each socket queues as they come from the engine before they are read, each of
#: at most `actors.engines.Vllm.max_frame` bytes (a larger one ends the connection that
#: sent it, unread: libzmq's ``MAXMSGSIZE``): 256 MiB a socket at the default 4 MiB,
#: whoever sends them. The engine waits (its
#: socket blocks) while the reader is behind; it never drops a frame.
_RCVHWM = 64

#: Frames waiting to be sent before the engine is taken as lost (it takes none).
_MAX_OUTBOX = 100_000

_ENCODER = msgspec.msgpack.Encoder()
_HANDSHAKE = msgspec.msgpack.Decoder(proto.Handshake)
_READY = msgspec.msgpack.Decoder(proto.ReadyResponse)
_OUTPUTS = msgspec.msgpack.Decoder(proto.EngineCoreOutputs)


#: The identity of engine 0 on its input sockets (its index, two bytes little-endian).
ENGINE_IDENTITY = (0).to_bytes(2, "little")


def bounded_socket(ctx: zmq.asyncio.Context, kind: int, max_frame: int) -> zmq.asyncio.Socket:
    """A socket to or from the engine that queues at most ``_SNDHWM`` frames to send and
    ``_RCVHWM`` received, none over ``max_frame`` bytes, and drops what it holds when
    closed."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _SNDHWM)
    sock.setsockopt(zmq.RCVHWM, _RCVHWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    return sock


def step_bytes(max_num_seqs: int) -> int:
    """The most bytes one step's outputs to one client may take: ``max_num_seqs`` requests
    at their largest, and the engine's statistics (as vLLM 0.32 writes them)."""
    return max_num_seqs * _OUTPUT_BYTES + _STATS_BYTES


def abort_frames(rid: str) -> list[bytes]:
    """The frames that ask the engine to stop generating ``rid`` (it answers nothing)."""
    return [proto.ABORT, _ENCODER.encode([rid])]


def engine_request(
    rid: str, prompt_ids: list[int], sampling: SamplingParams, eos: int | None, client: int = 0
) -> proto.EngineCoreRequest:
    """A request as vLLM's own front end sends it: the sampling parameters with the
    tokenizer's eos filled in, each output holding only the new ids (DELTA), the output
    going to client ``client``'s socket."""
    stop_ids = list(sampling.stop_token_ids)
    return proto.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        sampling_params=proto.EngineSampling(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            seed=sampling.seed if sampling.temperature > 0 else None,
            stop_token_ids=stop_ids,
            ignore_eos=sampling.ignore_eos,
            eos_token_id=None if sampling.ignore_eos else eos,
            all_stop_token_ids=sorted({*stop_ids, *(() if eos is None else (eos,))}),
        ),
        arrival_time=time.time(),
        client_index=client,
    )


class EngineLostError(TokenyardError, RuntimeError):
    """vLLM's engine is gone (dead, exited, disconnected, or silent): the scheduler that
    drives it ends, and its restart brings a new engine."""


class _Output:
    """What one request produced that nobody took yet."""

    __slots__ = ("finished", "ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.finished: str | None = None


def resolve_python(spec: Vllm) -> str:
    """The Python a launched engine runs with: ``spec.python``, ``$TOKENYARD_VLLM_PYTHON``,
    or ``.venv-vllm/bin/python``.

    Raises:
        FileNotFoundError: It does not exist (the message says how to make it).
    """
    python = spec.python or os.environ.get(PYTHON_ENV) or ".venv-vllm/bin/python"
    if not Path(python).is_file():
        raise FileNotFoundError(
            f"no Python for vLLM at {python}: build its venv with "
            "tests/engines/install-vllm.sh, then give its bin/python (Vllm.python, "
            f"serve --vllm-python, or ${PYTHON_ENV})"
        )
    return python


def engine_command(
    python: str, model: str, host: str, port: int, args: tuple[str, ...]
) -> list[str]:
    """The command that starts a headless engine which dials ``tcp://host:port``."""
    # -P: the launcher's directory (this package's) must not come first on sys.path, where
    # its ``http`` would hide the standard library's.
    return [
        python,
        "-P",
        str(CLI),
        "serve",
        model,
        "--headless",
        "--skip-tokenizer-init",
        "--data-parallel-address",
        host,
        "--data-parallel-rpc-port",
        str(port),
        *args,
    ]


def private_temp_env(directory: str) -> dict[str, str]:
    """The environment that gives an engine ``directory`` for its ipc sockets and its
    temporary files: vLLM leaves both behind, the sockets of an engine that was killed and,
    however it ended, the file of its process group's rendezvous (``vllm_dist_<uuid>``,
    a torch file store). torch's compile cache, which outlives the engine on purpose,
    stays where torch puts it by default (``torchinductor_<user>`` in the temporary
    directory), unless the environment names another."""
    env = {"VLLM_RPC_BASE_PATH": directory, "TMPDIR": directory}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # torch's default, as torch names it
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (a container's)
            user = f"uid_{os.getuid()}"
        sanitized = re.sub(r'[\\/:*?"<>|]', "_", user)
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), "torchinductor_" + sanitized
        )
    return env


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first (read from ``/proc``)."""
    found = [pid]
    for parent in found:  # grows as children are found
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                found.extend(int(c) for c in (task / "children").read_text().split())
    return found


def shared_memory_of(pid: int) -> set[Path]:
    """The ``/dev/shm`` files that ``pid`` and the processes below it have mapped.

    vLLM's executor talks to its workers through such a file (``psm_*``, a few hundred
    MB), which it removes when it shuts down cleanly; killed, it leaves it behind. Its
    launcher removes them once the engine is gone.
    """
    found: set[Path] = set()
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/"):  # noqa: S108 -- reading, not writing
                    found.add(Path(path[0].removesuffix(" (deleted)")))
    return found


class VllmModel:
    """vLLM's engine core behind the scheduler (see the module).

    Args:
        spec: Which engine, attached or launched.
        vocab_size: Ids ``0..vocab_size-1`` are the tokenizer's.
        eos: The tokenizer's end-of-sequence id, if any.
        notify: Called when output is ready, the engine becomes ready, or it is lost.
    """

    def __init__(
        self, spec: Vllm, *, vocab_size: int, eos: int | None, notify: Callable[[], None]
    ) -> None:
        self._spec = spec
        self._vocab_size = vocab_size
        self._eos = eos
        self._notify = notify
        self._ctx = zmq.asyncio.Context()
        self._handshake = self._socket(zmq.ROUTER)
        self._input = self._socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output = self._socket(zmq.PULL)
        self._monitor = self._input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        #: The engine's identity on the input socket, once it said HELLO.
        self._identity: bytes | None = None
        self.ready_response: proto.ReadyResponse | None = None
        #: Why the engine is lost (``None``: it is not).
        self._lost: str | None = None
        self._rids: dict[Hashable, str] = {}
        self._keys: dict[str, Hashable] = {}
        self._outputs: dict[Hashable, _Output] = {}
        self._has_output = False
        self._next_rid = 0
        self._next_call = 0
        self._outbox: deque[list[bytes]] = deque()
        self._outbox_ready = anyio.Event()
        self._heard_at = time.monotonic()
        self._process: asyncio.subprocess.Process | None = None
        #: The shared memory files of a launched engine, removed after it.
        self._shm: set[Path] = set()
        #: The private directory of a launched engine's ipc sockets ('' when none).
        self._rpc_dir = ""
        self._parent_pipe: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._bad = Throttle(logger)
        #: Frames from the engine that did not decode.
        self.rejected_frames = 0
        #: Outputs for requests no longer running (aborted, or unknown).
        self.dropped_outputs = 0
        #: Outputs whose ids are outside the vocabulary (their requests ended with abort).
        self.rejected_outputs = 0

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        return bounded_socket(self._ctx, kind, self._spec.max_frame)

    # -- the Generator ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (the model's must be the same)."""
        return self._vocab_size

    @property
    def eos(self) -> int | None:
        """The tokenizer's eos."""
        return self._eos

    @property
    def capacity(self) -> int:
        """The engine's ``max_num_seqs``; 0 until it is ready."""
        self._check()
        return 0 if self.ready_response is None else self.ready_response.max_num_seqs

    @property
    def pace(self) -> float:
        """No pause: each step is whatever came since the last."""
        return 0.0

    @property
    def context_length(self) -> int | None:
        """The engine's ``max_model_len``, once it is ready."""
        return None if self.ready_response is None else self.ready_response.max_model_len

    def admit(self, key: Hashable, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """Send the request to the engine (as an ADD frame, by the socket task): one the
        scheduler checked, as vLLM's front end checks what its engine sees (sampling
        parameters it takes, a prompt that leaves room in ``max_model_len``)."""
        self._check()
        assert self.ready_response is not None
        self._outputs[key] = _Output()
        rid = f"{self._next_rid:x}"
        self._next_rid += 1
        self._rids[key] = rid
        self._keys[rid] = key
        request = engine_request(rid, prompt_ids, sampling, self._eos)
        self._send([proto.ADD, _ENCODER.encode(request)])
        return 0

    def cancel(self, key: Hashable) -> None:
        """Abort it at the engine (which sends nothing more for it); forget it here."""
        self._outputs.pop(key, None)
        rid = self._rids.pop(key, None)
        if rid is None:
            return
        del self._keys[rid]
        if self._lost is None:
            self._send(abort_frames(rid))

    def ready(self) -> bool:
        """Whether some request produced ids, or ended, since the last take."""
        self._check()
        return self._has_output

    def take(self) -> dict[Hashable, Produced]:
        """Every request's ids since the last take, and the ends the engine reached."""
        self._check()
        taken: dict[Hashable, Produced] = {}
        self._has_output = False
        for key, output in list(self._outputs.items()):
            if not output.ids and output.finished is None:
                continue
            taken[key] = Produced(output.ids, output.finished)
            output.ids = []
            if output.finished is not None:
                del self._outputs[key]
                rid = self._rids.pop(key, None)
                if rid is not None:
                    del self._keys[rid]
        return taken

    def flush(self) -> bool:
        """Ask the engine to reset its prefix cache if nothing runs; whether nothing ran."""
        if self._rids or self._lost is not None or self._identity is None:
            return False
        self._send([proto.UTILITY, _ENCODER.encode((0, self._call_id(), "reset_prefix_cache", ()))])
        return True

    async def aclose(self) -> None:
        """Stop the socket task, end a launched engine, close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._stop_process()
        for sock in (self._monitor, self._handshake, self._input, self._output):
            sock.close(linger=0)
        self._ctx.term()

    # -- the socket task ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets (launching the engine, in launch mode) in the background task."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-engine")

    def _check(self) -> None:
        if self._lost is not None:
            raise EngineLostError(f"vLLM's engine is lost: {self._lost}")

    def _lose(self, reason: str) -> None:
        if self._lost is None:
            logger.error("vLLM's engine is lost: %s", reason)
            self._lost = reason
            self._forget_names()
        self._notify()

    def _forget_names(self) -> None:
        """Remove the names of a launched engine's shared memory files and ipc sockets (what
        is mapped stays mapped, and a bound socket works on, until its processes end): a
        killed engine cannot, and this process may be ended before `aclose` runs its
        course."""
        if self._process is not None:
            self._shm |= shared_memory_of(self._process.pid)
        for path in self._shm:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        """Remove the directory of a launched engine's ipc sockets."""
        if self._rpc_dir:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = ""

    def _send(self, frames: list[bytes]) -> None:
        if len(self._outbox) >= _MAX_OUTBOX:
            self._lose(f"it takes no requests ({len(self._outbox)} frames wait to be sent)")
            return
        self._outbox.append(frames)
        self._outbox_ready.set()

    def _call_id(self) -> int:
        self._next_call += 1
        return self._next_call

    async def _run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                started = time.monotonic()
                inputs, outputs, port = self._bind_all()
                spec = self._spec
                if spec.model is not None:
                    await self._launch(spec.model, spec.host, port)
                    tg.start_soon(self._watch_process)
                    with anyio.move_on_after(spec.start_timeout) as launching:
                        await self._connect(inputs, outputs)
                    if launching.cancelled_caught:
                        raise _Lost(f"it was not ready within start_timeout={spec.start_timeout} s")
                else:
                    await self._connect(inputs, outputs)
                self._ready_now(started)
                tg.start_soon(self._receive)
                tg.start_soon(self._deliver)
                tg.start_soon(self._watch_silence)
                tg.start_soon(self._watch_disconnect)
        except Exception as err:  # noqa: BLE001 -- whatever ends this task loses the engine
            self._lose(_reason(err))

    def _bind_all(self) -> tuple[str, str, int]:
        """Bind the three sockets: the input and output addresses, the handshake's port."""
        spec = self._spec
        if spec.handshake is not None:
            host = spec.handshake.removeprefix("tcp://").rsplit(":", 1)[0]
            self._handshake.bind(spec.handshake)
        else:
            host = spec.host
            self._handshake.bind(f"tcp://{host}:0")
        port = int(self._endpoint(self._handshake).rsplit(":", 1)[1])
        return self._bind(self._input, host), self._bind(self._output, host), port

    async def _connect(self, inputs: str, outputs: str) -> None:
        """Take the first engine that says HELLO through the handshake: it is ready when
        its ready response and READY came, within ``start_timeout`` of its HELLO."""
        identity = await self._hello()
        clients = self._spec.clients
        if clients and identity != ENGINE_IDENTITY:
            raise _Lost(
                f"its identity is {identity!r}, not {ENGINE_IDENTITY!r}: the workers that are "
                "its clients (Vllm.direct) reach engine 0 only (no data parallelism)"
            )
        self._identity = identity
        if clients:
            logger.warning(
                "the workers are the engine's clients at %s",
                ", ".join(f"{c.input} and {c.output}" for c in clients),
            )
        metadata = proto.HandshakeMetadata(
            addresses=proto.EngineAddresses(
                inputs=[inputs, *(c.input for c in clients)],
                outputs=[outputs, *(c.output for c in clients)],
            )
        )
        await self._handshake.send_multipart([identity, _ENCODER.encode(metadata)])
        timeout = self._spec.start_timeout
        with anyio.move_on_after(timeout) as waiting:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._ready_response, identity)
                tg.start_soon(self._ready_status, identity)
        if waiting.cancelled_caught:
            raise _Lost(f"it was not READY within start_timeout={timeout} s of its HELLO")

    def _ready_now(self, started: float) -> None:
        self._heard_at = time.monotonic()
        if self._process is not None:
            self._shm = shared_memory_of(self._process.pid)
        ready = self.ready_response
        assert ready is not None
        logger.warning(
            "vLLM %s engine ready: max_num_seqs %d, max_model_len %d, %.1f s after %s",
            ready.vllm_version,
            ready.max_num_seqs,
            ready.max_model_len,
            time.monotonic() - started,
            "its launch" if self._process else "the handshake socket was bound",
        )
        largest = step_bytes(ready.max_num_seqs)
        if largest > self._spec.max_frame:
            logger.warning(
                "vLLM's engine runs up to %d requests a step (max_num_seqs): one step's "
                "outputs may take about %d bytes, more than Vllm.max_frame=%d (serve "
                "--vllm-max-frame); a frame over it ends its connection unread, and the "
                "outputs it carried are lost: give at least %d",
                ready.max_num_seqs,
                largest,
                self._spec.max_frame,
                largest,
            )
        if ready.vllm_version and not ready.vllm_version.startswith(proto.VLLM_VERSION):
            logger.warning(
                "the engine runs vLLM %s; tokenyard speaks the protocol of %s",
                ready.vllm_version,
                proto.VLLM_VERSION,
            )
        self._notify()  # the capacity is no longer 0

    def _bind(self, sock: zmq.asyncio.Socket, host: str) -> str:
        sock.bind(f"tcp://{host}:0")
        return self._endpoint(sock)

    @staticmethod
    def _endpoint(sock: zmq.asyncio.Socket) -> str:
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    async def _launch(self, model: str, host: str, port: int) -> None:
        spec = self._spec
        python = resolve_python(spec)
        env = {**os.environ, **spec.env}
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM binds its own ipc sockets (engine core, workers) under the temporary
            # directory, and leaves files there: in a directory of its own, removed after it
            # (`_forget_names`, or its launcher when this process died).
            self._rpc_dir = tempfile.mkdtemp(prefix="tokenyard-vllm-")
            private = private_temp_env(self._rpc_dir)
            env.update({k: v for k, v in private.items() if k not in spec.env})  # its own win
            env["TOKENYARD_VLLM_RPC_DIR"] = self._rpc_dir
        read_end, write_end = os.pipe()
        os.set_inheritable(read_end, True)
        env["TOKENYARD_VLLM_PARENT_FD"] = str(read_end)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *engine_command(python, model, host, port, spec.args),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(read_end,),
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            self._remove_rpc_dir()
            raise
        finally:
            os.close(read_end)
        self._parent_pipe = write_end
        logger.warning("launched vLLM's engine (pid %d) on %s", self._process.pid, model)

    async def _hello(self) -> bytes:
        """The identity of the first engine that says HELLO."""
        while True:
            identity, body = await self._recv_pair(self._handshake, "handshake")
            try:
                said = _HANDSHAKE.decode(body)
            except msgspec.MsgspecError as err:
                self._reject("handshake", err)
                continue
            if said.status == "HELLO":
                logger.warning("vLLM engine %r said HELLO", identity)
                return identity

    async def _ready_response(self, identity: bytes) -> None:
        while True:
            sender, body = await self._recv_pair(self._input, "input")
            if sender != identity:
                continue
            try:
                self.ready_response = _READY.decode(body)
            except msgspec.MsgspecError as err:
                raise _Lost(f"its ready response does not decode: {err}") from err
            return

    async def _ready_status(self, identity: bytes) -> None:
        while True:
            sender, body = await self._recv_pair(self._handshake, "handshake")
            try:
                said = _HANDSHAKE.decode(body)
            except msgspec.MsgspecError as err:
                self._reject("handshake", err)
                continue
            if sender == identity and said.status == "READY":
                return
            logger.warning("another vLLM engine (%r) said %s: ignored", sender, said.status)

    async def _recv_pair(self, sock: zmq.asyncio.Socket, name: str) -> tuple[bytes, bytes]:
        """The next ``[identity, body]`` on a ROUTER (other shapes are rejected)."""
        while True:
            frames = await sock.recv_multipart()
            if len(frames) == 2:
                return frames[0], frames[1]
            self._reject(name, ValueError(f"{len(frames)} frames, not 2"))

    def _reject(self, where: str, err: Exception) -> None:
        self.rejected_frames += 1
        self._bad.warning("a frame from vLLM on its %s socket was rejected: %s", where, err)

    async def _receive(self) -> None:
        """Take the engine's outputs into the per-request buffers."""
        while True:
            # zmq.asyncio returns at once while frames wait, without suspending: an engine
            # that keeps sending would hold the scheduler's loop. One turn per frame.
            await anyio.lowlevel.checkpoint()
            frames = await self._output.recv_multipart()
            self._heard_at = time.monotonic()
            if frames[0] == proto.ENGINE_CORE_DEAD:
                raise _Lost("it sent ENGINE_CORE_DEAD (its log says why)")
            try:
                message = _OUTPUTS.decode(frames[0])
            except msgspec.MsgspecError as err:
                self._reject("output", err)
                continue
            if message.utility_output is not None and message.utility_output.failure_message:
                self._bad.warning(
                    "vLLM utility call failed: %s", message.utility_output.failure_message
                )
            self._take_outputs(message)

    def _take_outputs(self, message: proto.EngineCoreOutputs) -> None:
        got = False
        for out in message.outputs:
            key = self._keys.get(out.request_id)
            output = None if key is None else self._outputs.get(key)
            if output is None:
                self.dropped_outputs += 1
                continue
            ids = out.new_token_ids
            if outside_vocabulary(ids, self._vocab_size) is not None:
                # Not the model's (a forged frame, or another model behind the socket): the
                # detokenizer could not decode them. The request ends here, at the engine too.
                self._bad.warning(
                    "vLLM sent ids outside the vocabulary for %s: %s", out.request_id, ids[:8]
                )
                if out.finish_reason is None and output.finished is None:
                    self._send(abort_frames(out.request_id))
                output.finished = "abort"
                self.rejected_outputs += 1
                got = True
                continue
            output.ids.extend(ids)
            if out.finish_reason is not None:
                reason = proto.finish_reason_text(out.finish_reason)
                if out.finish_reason == proto.FinishReason.ERROR:
                    self._bad.warning("vLLM failed request %s", out.request_id)
                output.finished = reason
            got = True
        if got:
            self._has_output = True
            self._notify()

    async def _deliver(self) -> None:
        """Send the queued frames, in order, waiting while the engine takes none."""
        identity = self._identity
        assert identity is not None
        while True:
            while self._outbox:
                try:
                    await self._input.send_multipart([identity, *self._outbox[0]])
                except zmq.ZMQError as err:
                    raise _Lost(f"its input socket refuses frames: {err}") from err
                self._outbox.popleft()
            self._outbox_ready = anyio.Event()
            await self._outbox_ready.wait()

    async def _watch_silence(self) -> None:
        """Ask a silent engine whether it lives; give it up past ``silence_timeout``."""
        spec = self._spec
        while True:
            await anyio.sleep(spec.heartbeat / 2)  # sync-ok: a periodic liveness check
            silent = time.monotonic() - self._heard_at
            if silent > spec.silence_timeout:
                raise _Lost(f"it said nothing for {silent:.0f} s (silence_timeout)")
            if silent > spec.heartbeat:
                self._send(
                    [proto.UTILITY, _ENCODER.encode((0, self._call_id(), "is_sleeping", ()))]
                )

    async def _watch_disconnect(self) -> None:
        """A closed connection on the input socket is the engine gone (killed, say)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raise _Lost("it closed its connection")

    async def _watch_process(self) -> None:
        assert self._process is not None
        code = await self._process.wait()
        raise _Lost(f"its process exited ({_exit_text(code)})")

    async def _stop_process(self) -> None:
        """End a launched engine's process group: SIGTERM, then SIGKILL after the grace."""
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            self._shm |= shared_memory_of(process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with anyio.move_on_after(_STOP_GRACE):
                await process.wait()
        # Whatever of the group is left (its children, when the launcher ended first).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        self._forget_names()
        if self._parent_pipe is not None:
            os.close(self._parent_pipe)
            self._parent_pipe = None


class _Lost(Exception):
    """Why the socket task ends: the engine is lost."""


def _reason(err: BaseException) -> str:
    """What ended the socket task, as a sentence: the first `_Lost` in it, else the error."""
    if isinstance(err, BaseExceptionGroup):
        leaves = list(err.exceptions)
        lost = [e for e in leaves if isinstance(e, _Lost)]
        return _reason((lost or leaves)[0])
    if isinstance(err, _Lost):
        return str(err)
    return f"its client failed: {err!r}"


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"status {code}"


async def open_vllm(spec: Vllm, tokenizer: Any, notify: Callable[[], None]) -> VllmModel:
    """The generator over ``spec``'s engine, its connection under way in the background
    (capacity 0 until the engine is ready)."""
    if spec.model is not None:
        resolve_python(spec)  # fail now, with the fix in the message
    model = VllmModel(
        spec, vocab_size=vocab_size(tokenizer), eos=eos_token_id(tokenizer), notify=notify
    )
    model.start()
    return model
