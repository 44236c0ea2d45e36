"""What generates behind the scheduler: the engine contract's inside.

The pipeline's contract with an engine is the scheduler's messages (`actors.messages`):
token ids and sampling parameters in (`TokenizedGenerate`), each step's new ids, finish
reasons and usage out (`BatchTokenIDOutput`, per detokenizer), aborts, load and flush.
The `actors.scheduler.Scheduler` actor keeps that contract whatever generates: it queues
and admits requests, applies stop ids, eos and ``max_new_tokens``, reports aborts and
delivers every step. What generates the ids is a `Generator`, opened from an engine spec:

- `StandIn`: the deterministic fake model (zero cost: front-end benchmarks and tests).
- `LlamaCpp`: llama.cpp in the scheduler's process, on any GGUF whose vocabulary is the
  pipeline tokenizer's (the ``llamacpp`` extra; `actors._llamacpp_engine`).
- `Vllm`: vLLM's engine core in processes of its own, driven over its ZeroMQ protocol with
  tokenyard's own structs (`actors._vllm_engine`, `actors._vllm_protocol`): attached to an
  engine started elsewhere, or launched by the scheduler. By default the tokenizer workers
  are the engine's clients themselves (`Vllm.direct`, `actors._vllm_client`): their
  requests and outputs pass no other process, and the engine's own scheduler queues them.

A spec is a msgspec struct: it travels to the scheduler's process as a spawn argument.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from .messages import SamplingParams

__all__ = (
    "MAX_FRAME",
    "EngineClient",
    "EngineSpec",
    "Generator",
    "LlamaCpp",
    "Produced",
    "StandIn",
    "Vllm",
    "free_port_block",
    "open_generator",
)

K = TypeVar("K", bound="Hashable")
"""How a generator's caller names its requests."""


class StandIn(msgspec.Struct, frozen=True, kw_only=True, tag="stand-in"):
    """The stand-in engine: deterministic fake tokens, one per running request per step.

    Attributes:
        step_time: Seconds between two steps (0: none; the scheduler still yields between
            steps, so handlers run).
        seed: Mixed into every request's draws (same seed, same outputs).
        eos_probability: Chance per token, after a few tokens, that eos is drawn (0: never).
    """

    step_time: float = 0.0
    seed: int = 0
    eos_probability: float = 0.02

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_time) and self.step_time >= 0):
            raise ValueError(
                f"step_time must be a finite number of seconds, at least 0, got {self.step_time}"
            )
        if not 0 <= self.eos_probability <= 1:
            raise ValueError(f"eos_probability must be within [0, 1], got {self.eos_probability}")


class LlamaCpp(msgspec.Struct, frozen=True, kw_only=True, tag="llamacpp"):
    """llama.cpp, in the scheduler's own process (continuous batching over its slots).

    Attributes:
        model: A GGUF file whose vocabulary is the pipeline tokenizer's
            (``python -m actors make-model DIR`` writes a tiny one, with its tokenizer).
        n_parallel: Slots: requests generated together; more wait at the scheduler.
        context_length: Prompt plus completion tokens of one request (each slot's share
            of llama.cpp's KV cache).
        threads: CPU threads llama.cpp computes with.
    """

    model: str
    n_parallel: int = 4
    context_length: int = 2048
    threads: int = 1

    def __post_init__(self) -> None:
        # A context holds a prompt token and a generated one at the least.
        for name, least in (("n_parallel", 1), ("context_length", 2), ("threads", 1)):
            if getattr(self, name) < least:
                raise ValueError(
                    f"LlamaCpp.{name}={getattr(self, name)}: it must be at least {least}"
                )


#: `Vllm.max_frame`'s default: the largest frame, in bytes, a socket takes from vLLM's engine.
MAX_FRAME = 4 << 20

#: The bounds of `Vllm.max_frame`: below, a step of a few requests may not fit; above, the
#: 64 frames a socket holds could take 64 GiB.
_MIN_FRAME = 64 << 10
_MAX_FRAME_LIMIT = 1 << 30


class EngineClient(msgspec.Struct, frozen=True):
    """Where one tokenizer worker talks to vLLM's engine itself (`Vllm.direct`).

    The worker binds both addresses for the pipeline's whole life (a restarted worker binds
    them again) and the engine connects to them: the scheduler's handshake lists them after
    its own, so the worker is the engine's client number ``index``.

    Attributes:
        index: The engine's ``client_index`` of the worker's requests (1 and up: 0 is the
            scheduler's).
        input: The worker's ROUTER, where it sends requests.
        output: The worker's PULL, where the engine pushes their outputs.
        unreachable_after: `Vllm.unreachable_after`.
        heartbeat: `Vllm.heartbeat`: while the engine runs a request of the worker's and
            says nothing on its output, the worker asks it whether it lives this often.
        silence_timeout: `Vllm.silence_timeout`: past it without a word on the output
            (outputs, or the answer), the worker fails what the engine ran for it.
        max_frame: `Vllm.max_frame`: the largest frame the worker's sockets take.
    """

    index: int
    input: str
    output: str
    unreachable_after: float = 15.0
    heartbeat: float = 5.0
    silence_timeout: float = 60.0
    max_frame: int = MAX_FRAME


class Vllm(msgspec.Struct, frozen=True, kw_only=True, tag="vllm"):
    """vLLM's engine core, in processes of its own.

    **Who its clients are** (``direct``): by default each tokenizer worker is a client of
    its own, as each of vLLM's API servers is: a worker sends its requests to the engine and
    takes their outputs straight from it, and detokenizes them itself, with no hop through
    another process. The scheduler stays the engine's keeper: it makes the handshake (naming
    every worker's addresses), launches and restarts the engine and watches that it lives,
    and its own client serves nothing else. The engine's own scheduler queues and admits
    the requests. With ``direct=False`` the scheduler is the engine's one client and every
    request goes through it, its queue and its bounds, and through a detokenizer.

    Give exactly one of ``handshake`` (attach) and ``model`` (launch):

    - **attach**: the scheduler binds the handshake socket at ``handshake`` and waits for an
      engine started elsewhere with ``vllm serve MODEL --headless --skip-tokenizer-init
      --data-parallel-address H --data-parallel-rpc-port P``. An engine takes one handshake
      per start: when the scheduler restarts, it waits for an engine started anew.
    - **launch**: the scheduler starts ``vllm serve model --headless --skip-tokenizer-init``
      (and ``args``) from ``python``'s venv as its own child, which dies with it; a
      restarted scheduler launches a new engine.

    Attributes:
        handshake: Attach: ``tcp://HOST:PORT`` to bind the handshake socket at (the input
            and output sockets are bound on the same host, at ports the system picks).
        model: Launch: the model directory (or name) given to ``vllm serve``.
        args: Launch: more ``vllm serve`` arguments (``--max-num-seqs 16``, ...).
        python: Launch: the Python of the venv vLLM is installed in (``""``:
            ``$TOKENYARD_VLLM_PYTHON``, else ``.venv-vllm/bin/python``).
        env: Launch: environment variables set for the engine (``OMP_NUM_THREADS``,
            ``VLLM_CPU_KVCACHE_SPACE``, ...), on top of the scheduler's.
        host: Launch: the interface the sockets are bound on.
        start_timeout: Seconds from the launch, or from the engine's HELLO when attached,
            to its READY; past it, the engine is taken as lost.
        heartbeat: Seconds of silence after which the engine is asked whether it lives.
        silence_timeout: Seconds without a word from the engine (outputs, or the answer to
            a heartbeat) after which it is taken as lost.
        direct: Each tokenizer worker a client of the engine (above).
        client_port: Attach, direct: the first of the ports the workers bind on the
            handshake's host, two each, in worker order (0: a block of ports free when
            the pipeline starts, below the system's ephemeral range, so that no outgoing
            connection takes one while its worker restarts). Launched, the engine is on
            this host: the workers bind Unix sockets in the system's private directory.
        unreachable_after: Direct: seconds a worker's requests wait for the engine to be
            connected to it (a port not opened, a wrong host) before they fail, and the
            worker says why in ``/health`` until the engine is back.
        clients: Filled by the pipeline, not by hand: each direct worker's addresses.
        max_frame: The largest frame, in bytes, a socket to the engine takes (the
            scheduler's, each direct worker's): a larger one ends the connection that sent
            it, unread (libzmq's ``MAXMSGSIZE``), and the outputs it carried are lost. Each
            socket holds at most 64 frames the engine sent and its reader has not taken:
            256 MiB at the default 4 MiB. One step's outputs take about 300 bytes a request
            at most, so 4 MiB holds a step of over 13,000 requests; the scheduler warns at
            the engine's start when its ``max_num_seqs`` could make a larger one.
    """

    handshake: str | None = None
    model: str | None = None
    args: tuple[str, ...] = ()
    python: str = ""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    host: str = "127.0.0.1"
    start_timeout: float = 600.0
    heartbeat: float = 5.0
    silence_timeout: float = 60.0
    direct: bool = True
    client_port: int = 0
    unreachable_after: float = 15.0
    clients: tuple[EngineClient, ...] = ()
    max_frame: int = MAX_FRAME

    def __post_init__(self) -> None:
        if (self.handshake is None) == (self.model is None):
            raise ValueError(
                "Vllm needs exactly one of handshake= (attach to an engine that dials in) "
                f"and model= (launch one); got handshake={self.handshake!r}, "
                f"model={self.model!r}"
            )
        if self.handshake is not None and not self.handshake.startswith("tcp://"):
            raise ValueError(
                f"Vllm.handshake={self.handshake!r}: give tcp://HOST:PORT (vLLM's engines "
                "dial tcp://<--data-parallel-address>:<--data-parallel-rpc-port>)"
            )
        for name in ("start_timeout", "heartbeat", "silence_timeout", "unreachable_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Vllm.{name}={getattr(self, name)}: it must be positive")
        if self.silence_timeout <= self.heartbeat:
            raise ValueError(
                f"Vllm.silence_timeout={self.silence_timeout} must exceed "
                f"heartbeat={self.heartbeat}: the engine is asked before it is given up"
            )
        if not 0 <= self.client_port < 65536:
            raise ValueError(f"Vllm.client_port={self.client_port}: give a TCP port, or 0")
        if not _MIN_FRAME <= self.max_frame <= _MAX_FRAME_LIMIT:
            raise ValueError(
                f"Vllm.max_frame={self.max_frame}: give bytes within [{_MIN_FRAME}, "
                f"{_MAX_FRAME_LIMIT}] (the largest frame a socket takes from the engine)"
            )
        if self.clients and not self.direct:
            raise ValueError("Vllm.clients are the direct workers': none with direct=False")

    def with_clients(self, workers: int, directory: str | None) -> Vllm:
        """This spec with ``workers`` direct clients' addresses filled in (itself when not
        ``direct``).

        Attached, worker ``k`` binds ``client_port + 2k`` (input) and the port after it
        (output) on the handshake's host (``client_port`` 0: `free_port_block` picks them
        now). Launched, the engine is on this host: ``directory/vllm-<k>-in`` and ``-out``
        (the system's private directory, which only its owner can enter), or, with none,
        loopback ports as attached.

        Raises:
            OSError: ``client_port`` is 0 and no block of free ports was found.
        """
        if not self.direct:
            return self
        if self.handshake is None and directory:
            addresses = [
                (f"ipc://{directory}/vllm-{k}-in", f"ipc://{directory}/vllm-{k}-out")
                for k in range(workers)
            ]
        else:
            host = (
                self.handshake.removeprefix("tcp://").rsplit(":", 1)[0]
                if self.handshake is not None
                else self.host
            )
            first = self.client_port or free_port_block(host, 2 * workers)
            if first + 2 * workers > 65536:
                raise ValueError(
                    f"Vllm: {workers} workers need ports {first} to {first + 2 * workers - 1}; "
                    "give a lower client_port"
                )
            addresses = [
                (f"tcp://{host}:{first + 2 * k}", f"tcp://{host}:{first + 2 * k + 1}")
                for k in range(workers)
            ]
        clients = [
            EngineClient(
                k + 1,
                i,
                o,
                self.unreachable_after,
                self.heartbeat,
                self.silence_timeout,
                self.max_frame,
            )
            for k, (i, o) in enumerate(addresses)
        ]
        return msgspec.structs.replace(self, clients=tuple(clients))


def free_port_block(host: str, count: int, *, tries: int = 200) -> int:
    """The first of ``count`` consecutive TCP ports free on ``host`` now, below the
    system's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where no
    outgoing connection is given one, and above 10,000, where services tend not to listen.

    Raises:
        OSError: ``tries`` random blocks were not all free.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    floor = 10_000 if low - count > 10_000 else 1024
    pick = random.SystemRandom()
    for _ in range(tries):
        first = pick.randrange(floor, max(low - count, floor + 1))
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((host, port))
            except OSError:
                continue
        return first
    raise OSError(f"no {count} consecutive free ports on {host} in {tries} tries; give some")


EngineSpec = StandIn | LlamaCpp | Vllm
"""Every engine the scheduler can drive, as a tagged union of specs."""


class Produced(NamedTuple):
    """What one request produced since the previous step.

    Attributes:
        ids: Its new ids, in order (every one of them: the detokenizer decodes them all).
        finished: ``"stop"`` or ``"length"`` when the generator ended it itself (its eos,
            its context), else ``None``. Stop ids, eos and ``max_new_tokens`` are applied by
            the scheduler as well, whatever the generator does.
    """

    ids: list[int]
    finished: str | None = None


class Generator(Protocol[K]):
    """What produces token ids for the requests the scheduler admits.

    All of it is called from the scheduler's event loop. ``notify`` (given when it is
    opened) is called, from any thread, when output is ready to `take`.
    """

    @property
    def vocab_size(self) -> int:
        """Ids ``0..vocab_size-1`` are the vocabulary; prompts with others are refused."""
        ...

    @property
    def eos(self) -> int | None:
        """The end-of-sequence id, if the model has one."""
        ...

    @property
    def capacity(self) -> int | None:
        """Most requests it runs at once (``None``: as many as the scheduler admits; 0:
        none for now, as an engine that is not connected yet; ``notify`` is called when
        that changes)."""
        ...

    @property
    def pace(self) -> float:
        """Seconds the scheduler waits after each step (the stand-in's step time)."""
        ...

    @property
    def context_length(self) -> int | None:
        """Most prompt plus generated ids of one request, when the engine bounds them
        (``None``: it does not, or it does not know yet)."""
        ...

    def admit(self, key: K, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """Start generating for a request; returns how many prompt ids were cached. The
        scheduler admits only what it checked: ids within `vocab_size`, sampling
        parameters an engine takes (`actors._limits.sampling_refusal`), at least one id to
        generate, and a prompt shorter than `context_length`."""
        ...

    def cancel(self, key: K) -> None:
        """Stop generating for a request (aborted, or ended by the scheduler); forget it."""
        ...

    def ready(self) -> bool:
        """Whether a `take` would return output."""
        ...

    def take(self) -> dict[K, Produced]:
        """What the running requests produced since the last take: one step's output."""
        ...

    def flush(self) -> bool:
        """Forget cached prefixes if nothing runs; whether it did."""
        ...

    async def aclose(self) -> None:
        """Stop every generation and release what it holds."""
        ...


async def open_generator(
    spec: EngineSpec, tokenizer: str | None, notify: Callable[[], None]
) -> Generator[Any]:
    """The generator ``spec`` describes, ready to admit requests.

    Args:
        spec: Which engine, and its settings.
        tokenizer: The pipeline's ``tokenizer.json`` (``None``: the bundled one).
        notify: Called, from any thread, when output is ready.
    """
    from ._tokenizer import load_tokenizer

    match spec:
        case StandIn():
            from ._fake_model import FakeModel

            return FakeModel(spec, load_tokenizer(tokenizer))
        case LlamaCpp():
            from ._llamacpp_engine import open_llamacpp

            return await open_llamacpp(spec, load_tokenizer(tokenizer), notify)
        case Vllm():
            from ._vllm_engine import open_vllm

            return await open_vllm(spec, load_tokenizer(tokenizer), notify)
