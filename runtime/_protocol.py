"""The runtime's wire protocol on one screen: frame kinds, the header, the control bodies and
the one death record.

A ``tell`` travels as one frame: the msgpack body alone, unless it carries trace context
(then it is a ``TELL`` with a header); the tells after the first that one process makes to
one mailbox in one turn of its event loop travel together, as one ``TELLS`` (a `Bundle`).
Everything else (asks, replies, control) travels as
``[header, body, *buffers]`` so a router can read the header and pass the
body on as ``msgspec.Raw`` without decoding it. A header frame starts with 0xC1, the one byte
msgpack never uses, so a receiver tells the two apart from the first byte alone.

Every header carries the system's cookie, and a frame whose header lacks it is refused
wherever it arrives: a process outside the system cannot ask, answer, stop, watch or report
anything. Correlation ids and spawn tokens are random 63-bit numbers, so a reply or a
readiness report cannot be guessed either.
"""

from __future__ import annotations

import enum
import functools
import hmac
import os
import secrets
import struct
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from ._errors import ProtocolError
from ._message import Message
from ._ref import ActorRef

if TYPE_CHECKING:
    from collections.abc import Sequence


class Kind(enum.IntEnum):
    """What a multi-frame message is."""

    ASK = 1
    """A request for a handler's reply (body: the message)."""
    REPLY = 2
    """A handler's return value (body: of ``Header.body_type``)."""
    ERROR = 3
    """A handler's failure, or a refused ask (body: `ErrorBody`)."""
    STOP = 4
    """Stop gracefully after what came before (answered with an empty reply)."""
    READY = 5
    """A new actor process finished ``on_start`` (body: `ReadyBody`), to its parent."""
    FAILED = 6
    """An actor process's last words before exiting 1 (body: `ErrorBody`), to its parent."""
    STATS = 7
    """Ask a mailbox for its counters (answered with ``MailboxStatistics``)."""
    WATCH = 8
    """Ask a node to report an actor's death (body: `WatchBody`)."""
    DOWN = 9
    """A node's report of an actor's death (body: `Down`)."""
    LOOKUP = 10
    """Which live incarnation has a name (body: `LookupQuery`; reply: `LookupReply`). Sent to
    a process's reply inbox, it is answered there (an ``ANSWER`` holding the `LookupReply`)
    whatever its actors are busy with; sent to a mailbox (a child on another node, whose
    process's inbox is not known), in the mailbox's order."""
    FLUSH = 11
    """Answered once everything sent before it on the same pipe was handled."""
    PING = 12
    """A liveness probe of a node, answered from its event loop at once with PONG."""
    PONG = 13
    """The answer to a PING."""
    UNWATCH = 14
    """A watching node that closes: forget it (body: `WatchBody`)."""
    METRICS = 15
    """Ask a mailbox for the statistics of its process and every process under it (body:
    `MetricsQuery`, or empty; answered with ``SystemMetrics``)."""
    JOIN = 16
    """A node on another host joins the system (body: `NodeHello`; answer: `NodeList`)."""
    SPAWN = 17
    """Start an actor on the node asked (body: `RemoteSpawn`; reply: `RemoteSpawned`)."""
    KILL = 18
    """End an actor of the node asked at once (body: `RemoteKill`; reply: empty)."""
    NODES = 19
    """Which nodes the system has now (answer: `NodeList`), asked of its root."""
    ANSWER = 20
    """The answer to a JOIN, SPAWN or KILL (body: the request's answer)."""
    TELL = 21
    """A one-way message that carries trace context (body: the message). An untraced tell
    has no header at all."""
    TELLS = 22
    """Several one-way messages from one sender to one mailbox, in order, as one frame
    (body: `Bundle`): the tells a sender made to one address in one turn of its event
    loop, after the first, and every traced tell."""


#: Most trace contexts one message carries (one per request of a batch), and the longest
#: one (a W3C ``traceparent`` is 55 characters): bounds on what a header decodes into,
#: whoever sent it.
MAX_TRACE = 65_536
MAX_TRACE_CHARS = 512

_Context = Annotated[str, msgspec.Meta(max_length=MAX_TRACE_CHARS)]


class Header(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The small typed header of a multi-frame message.

    Attributes:
        kind: What the message is.
        corr: Correlation id: an ask and its reply carry the same one.
        reply_to: Address the reply goes to ('' when none is wanted).
        sender: Name of the sending actor or system, for logs.
        body_type: ``module:QualName`` of a reply body ('' for ``None``).
        frames: How many frames follow the header (the body, then extra buffers).
        cookie: The system's secret: a header without it is refused.
        trace: Trace context of what the body carries, opaque to the runtime: a W3C
            ``traceparent`` for a message about one request, one per request for a batch
            (in the order the body lists them, ``""`` for an untraced one); empty when
            untraced. The handler reads it with `runtime.current_trace`. At most
            `MAX_TRACE` contexts of `MAX_TRACE_CHARS` characters each.
    """

    kind: Kind
    corr: int = 0
    reply_to: str = ""
    sender: str = ""
    body_type: str = ""
    frames: int = 1
    cookie: bytes = b""
    trace: Annotated[tuple[_Context, ...], msgspec.Meta(max_length=MAX_TRACE)] = ()


#: The framed kinds whose body goes to the actor's handler.
HANDLED_KINDS = frozenset({Kind.ASK, Kind.TELL})
#: The kinds of the node protocol (`runtime._nodes`), taken by a node's reply inbox.
NODE_KINDS = frozenset({Kind.JOIN, Kind.SPAWN, Kind.KILL, Kind.NODES})
#: First byte of every header frame (msgpack never emits it).
HEADER_MARK = 0xC1
HEADER_BYTE = bytes([HEADER_MARK])
#: Most frames a header may announce (body plus extra buffers).
MAX_FRAMES = 64
#: Correlation ids and spawn tokens are drawn from [1, 2**63), from the system's CSPRNG
#: (``os.urandom``) this many at a time: one ``getrandom`` call each cost an ask 0.6 us.
_CORR_BATCH = 512
_corr_format = struct.Struct(f"<{_CORR_BATCH}Q")
#: Drawn, not yet used; emptied in a forked child, which must not use its parent's next ids.
_corrs: list[int] = []
os.register_at_fork(after_in_child=_corrs.clear)


def new_corr() -> int:
    """A fresh unguessable correlation id (never 0, which means "no reply wanted")."""
    try:
        return _corrs.pop() or 1
    except IndexError:
        _corrs.extend(n >> 1 for n in _corr_format.unpack(os.urandom(_corr_format.size)))
        return _corrs.pop() or 1


def new_cookie() -> bytes:
    """A fresh system secret."""
    return secrets.token_bytes(16)


def cookie_ok(header: Header, cookie: bytes) -> bool:
    """Whether ``header`` carries the system's cookie (compared in constant time)."""
    return hmac.compare_digest(header.cookie, cookie)


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)


def encode_header(header: Header) -> bytearray:
    """The header frame: the mark byte, then the msgpack header."""
    buf = bytearray(HEADER_BYTE)
    _header_encoder.encode_into(header, buf, 1)
    return buf


class HeaderTemplate:
    """The untraced header of one kind from one sender, encoded once but for its
    correlation id: what an ask or a reply costs to head is then a concatenation.

    An array-like header encodes its fields in order, the kind (a one-byte integer) and the
    correlation id first: the template is the bytes before the id and those after it, and
    the id is encoded between them as msgpack encodes any integer.

    Args:
        kind: The kind.
        reply_to: The sender's reply address.
        sender: The sender's name.
        cookie: The system's cookie.
        body_type: The reply body's type path ('' for none).
    """

    def __init__(
        self, kind: Kind, reply_to: str, sender: str, cookie: bytes, body_type: str = ""
    ) -> None:
        whole = encode_header(Header(kind, 0, reply_to, sender, body_type, cookie=cookie))
        # The mark, a fixarray of the header's fields, the kind, then the id 0 (one byte).
        assert whole[1] == 0x90 + len(Header.__struct_fields__)
        assert whole[3] == 0
        self._prefix = bytes(whole[:3])
        self._suffix = bytes(whole[4:])

    def encode(self, corr: int) -> bytes:
        """The header with ``corr``: the same bytes as `encode_header` gives."""
        return self._prefix + _header_encoder.encode(corr) + self._suffix


def decode_header(frame: bytes) -> Header:
    """Decode a header frame (the caller has checked the mark byte)."""
    return _header_decoder.decode(memoryview(frame)[1:])


#: Most tells one `Kind.TELLS` frame carries (its bytes are bounded by the message size).
MAX_BUNDLE = 4_096

_Trace = Annotated[tuple[_Context, ...], msgspec.Meta(max_length=MAX_TRACE)]

Bundle = Annotated[list[bytes | tuple[bytes, _Trace]], msgspec.Meta(max_length=MAX_BUNDLE)]
"""The body of a `Kind.TELLS` frame: each tell's encoded message, in the order told; a
traced one as ``(message, trace)``, its trace context as a header's ``trace``."""

bundle_decoder: msgspec.msgpack.Decoder[list[bytes | tuple[bytes, tuple[str, ...]]]] = (
    msgspec.msgpack.Decoder(Bundle)
)


class Traced(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A traced tell as a mailbox takes it, the message left undecoded until just before
    its handler.

    Attributes:
        body: The encoded message.
        trace: Its trace context, current while its handler runs.
    """

    body: bytes
    trace: _Trace

    def __len__(self) -> int:
        """The bytes it counts for in its mailbox's budget: its message's."""
        return len(self.body)


class _Bundled(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A traced tell of a bundle as it decodes: the ``[message, [context, ...]]`` pair of a
    `Bundle`, its contexts left as their bytes (`TellsDecoder` decodes them). It has no
    length, unlike a tell's frame: how a decoder finds that a bundle holds one."""

    body: bytes
    trace: msgspec.Raw


_bundled_decoder: msgspec.msgpack.Decoder[list[bytes | _Bundled]] = msgspec.msgpack.Decoder(
    Annotated[list[bytes | _Bundled], msgspec.Meta(max_length=MAX_BUNDLE)]
)
_trace_decoder: msgspec.msgpack.Decoder[tuple[str, ...]] = msgspec.msgpack.Decoder(_Trace)


#: The longest encoding a `TellsDecoder` remembers, a header's or contexts' (a batch of 32
#: ``traceparent`` contexts is 1.8 kB), and the most contexts it remembers (a string
#: object each, about 50 bytes beside its characters): what repeats is small, and no peer
#: makes a mailbox keep more than some 32 kB in each of its two memories.
REMEMBERED_BYTES = 16_384
REMEMBERED_CONTEXTS = 256


class TellsDecoder:
    """Decodes the headers and bundles of the tells a mailbox receives, once what repeats.

    Tells repeat their headers byte for byte: a ``TELLS`` header is the same for every
    bundle from one sender, and a traced tell's ``TELL`` header differs only by its trace
    context. And the traced tells of a stream mostly carry the contexts of the tell before
    them: a batch's requests, step after step, or one request's every tell. So a decoder
    remembers the last such header it decoded, and the last contexts of a bundle's traced
    tell, by their bytes (up to `REMEMBERED_BYTES` of them and `REMEMBERED_CONTEXTS`
    contexts), and gives what it decoded again when the same bytes come: the same
    `Header`, the same tuple of contexts, both immutable. Whatever differs is decoded and
    checked against its bounds as before; contexts that do not decode refuse their whole
    bundle.
    """

    __slots__ = ("_frame", "_header", "_raw", "_trace")

    def __init__(self) -> None:
        self._frame = b""  # a tell's header frame, and its decoding
        self._header = Header(Kind.TELL)
        self._raw = msgspec.Raw()  # the bytes of `_trace`'s encoding (none yet)
        self._trace: tuple[str, ...] = ()

    def header(self, frame: bytes) -> Header:
        """Decode a header frame (the caller has checked the mark byte) as
        `decode_header` does.

        Raises:
            msgspec.DecodeError: It does not decode.
        """
        if frame == self._frame:
            return self._header
        header = decode_header(frame)
        if header.kind in _REPEATED and _small(len(frame), header.trace):
            self._frame, self._header = frame, header
        return header

    def bundle(self, body: bytes) -> tuple[list[bytes | Traced], int]:
        """The tells of a `Bundle`'s body, in order (each tell's frame, or a `Traced`), and
        the bytes of their messages.

        Raises:
            msgspec.DecodeError: The body, or a context in it, does not decode.
        """
        items: list[Any] = _bundled_decoder.decode(body)
        try:  # the sum a mailbox needs, at C speed, and no traced tell: nothing more to do
            return items, sum(map(len, items))
        except TypeError:  # a traced tell (a `_Bundled` has no length): each looked at
            pass
        raw, trace = self._raw, self._trace
        held = 0
        for i, item in enumerate(items):
            if type(item) is not _Bundled:
                held += len(item)
                continue
            if item.trace != raw:
                trace = _trace_decoder.decode(item.trace)
                # Its own bytes, not a view that would keep the whole bundle's.
                raw = item.trace.copy() if _small(len(item.trace), trace) else _NONE
            body = item.body
            items[i] = Traced(body, trace)
            held += len(body)
        # Contexts too large to remember are not kept either: their tells hold them while
        # they wait, and no longer.
        self._raw, self._trace = raw, (() if raw is _NONE else trace)
        return items, held


#: The kinds of header a `TellsDecoder` remembers: they carry no correlation id, so a
#: sender's repeat byte for byte.
_REPEATED = frozenset((Kind.TELL, Kind.TELLS))
_NONE = msgspec.Raw()


def _small(size: int, trace: tuple[str, ...]) -> bool:
    """Whether a `TellsDecoder` remembers what ``size`` bytes decoded into, with ``trace``."""
    return size <= REMEMBERED_BYTES and len(trace) <= REMEMBERED_CONTEXTS


class TellHeaders:
    """The headers of one sender's tells, encoded once: a bundle's (`Kind.TELLS`), and a
    traced tell's (`Kind.TELL`) up to its trace context, the header's last field.

    Args:
        sender: The sending node's name.
        cookie: The system's cookie.
    """

    def __init__(self, sender: str, cookie: bytes) -> None:
        self.bundle = bytes(encode_header(Header(Kind.TELLS, sender=sender, cookie=cookie)))
        empty = encode_header(Header(Kind.TELL, sender=sender, cookie=cookie))
        # An array-like struct encodes every field in order: the empty trace is its last
        # byte (an empty msgpack array), and a traced tell's header is the rest followed by
        # its trace context.
        assert empty[-1] == 0x90
        self._traced = bytes(empty[:-1])

    def traced(self, trace: tuple[str, ...]) -> bytes:
        """The header of a tell carrying ``trace`` (checked by `checked_trace`)."""
        return self._traced + _trace_encoder.encode(trace)


_trace_encoder = msgspec.msgpack.Encoder()


def checked_trace(trace: Sequence[str]) -> tuple[str, ...]:
    """``trace`` as a tuple of contexts (a string is one), within its bounds.

    Raises:
        ProtocolError: More than `MAX_TRACE` contexts, or one longer than
            `MAX_TRACE_CHARS` (the receiver would refuse the message).
    """
    contexts = trace if type(trace) is tuple else contexts_of(trace)
    trace_chars(contexts)
    return contexts


def contexts_of(trace: Sequence[str]) -> tuple[str, ...]:
    """``trace`` as a tuple of contexts, unchecked: one traceparent given as a string is one
    context, not one per character."""
    return (trace,) if isinstance(trace, str) else tuple(trace)


def trace_chars(contexts: tuple[str, ...]) -> int:
    """The characters of all ``contexts`` together, once they are checked to be within
    their bounds (what a traced tell adds to a bundle's bytes, near enough).

    A traced tell pays for this check, so it is cheap when it can be: contexts whose
    characters add up to no more than `MAX_TRACE_CHARS` (one ``traceparent``, a few) hold
    no context longer than that, and only longer traces are looked at one by one.

    Raises:
        ProtocolError: As `checked_trace`.
    """
    chars = len("".join(contexts))
    if len(contexts) > MAX_TRACE or (
        chars > MAX_TRACE_CHARS and max(map(len, contexts)) > MAX_TRACE_CHARS
    ):
        raise ProtocolError(
            f"trace= holds {len(contexts):,} contexts, the longest of "
            f"{max(map(len, contexts)):,} characters: a message carries at most "
            f"{MAX_TRACE:,} (one per request of a batch) of {MAX_TRACE_CHARS} each"
        )
    return chars


# -- control bodies ---------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, array_like=True, frozen=True):
    """A failure carried as data: the remote exception's type, text and traceback."""

    type_name: str
    message: str
    traceback: str

    @classmethod
    def of(cls, err: BaseException) -> ErrorBody:
        """The body describing ``err``, with its formatted traceback."""
        import traceback

        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return cls(f"{type(err).__module__}.{type(err).__qualname__}", str(err), tb)


class ReadyBody(msgspec.Struct, array_like=True, frozen=True):
    """Sent by a freshly started actor once ``on_start`` has finished."""

    address: str
    pid: int
    #: The reply inbox of the new process's station (where its actors' deaths are known).
    station: str = ""


class WatchBody(msgspec.Struct, array_like=True, frozen=True):
    """Asks an actor's owning node to report its death to ``subscriber``."""

    ref: ActorRef[Any]
    subscriber: str


class LookupQuery(Message):
    """Which live incarnation answers to ``name`` under this actor's system (control).

    Attributes:
        name: The name.
        timeout: Seconds the system asked has to search the processes under it: the
            asker's time to wait, its `NESTED_GATHER_SHARE`, so that the answer comes back
            before the asker gives up. Not a number within bounds (0: a sender from before
            it): `DEFAULT_LOOKUP_TIMEOUT`.
    """

    name: str
    timeout: float = 0.0

    def search_time(self) -> float:
        """``timeout`` if it is within bounds, else `DEFAULT_LOOKUP_TIMEOUT`."""
        if 0 < self.timeout <= MOST_LOOKUP_TIMEOUT:
            return self.timeout
        return DEFAULT_LOOKUP_TIMEOUT


class MetricsQuery(Message):
    """How long the processes under a mailbox's have to answer its gathering (control).

    An empty body (a sender from before it) leaves `DEFAULT_GATHER_TIMEOUT`.
    """

    timeout: float


#: Seconds each process under a mailbox has to answer its gathering, unless asked otherwise.
DEFAULT_GATHER_TIMEOUT = 5.0
#: The share of its own time to answer that a process gives the processes under it (what
#: is left carries their answers back): of a gathering's, and of a lookup's.
NESTED_GATHER_SHARE = 0.75
#: Seconds a lookup searches unless told otherwise (`ActorSystem.lookup`'s default, and a
#: peer's lookup that says none), and the longest a peer may ask for.
DEFAULT_LOOKUP_TIMEOUT = 5.0
MOST_LOOKUP_TIMEOUT = 3600.0


class LookupReply(Message):
    """The answer to a ``LookupQuery``: the ref, or ``None`` when nobody has that name."""

    ref: ActorRef[Any] | None = None


class NodeHello(msgspec.Struct, array_like=True, frozen=True):
    """A node's first word to the system's root.

    Attributes:
        name: The node's name, unique in the system.
        address: Its reply inbox (where spawn and kill requests go, and its actors' owner).
        host: The host its mailboxes bind on.
        pid: Its process id, for people.
    """

    name: str
    address: str
    host: str
    pid: int = 0


class NodeInfo(msgspec.Struct, array_like=True, frozen=True):
    """One node of the system, as every node learns of it."""

    name: str
    address: str
    host: str


class NodeList(msgspec.Struct, array_like=True, frozen=True):
    """The system's nodes now, as its root knows them (the answer to JOIN and NODES).

    Attributes:
        root: The root's reply inbox, as its pings name it.
        nodes: The nodes.
        heartbeat: The root's heartbeat (it pings its nodes every eighth of it); 0: unsaid.
    """

    root: str
    nodes: list[NodeInfo]
    heartbeat: float = 0.0


StartMethod = Literal["fork-server", "spawn"]
"""How an actor process starts: forked from the system's fork server, or a fresh interpreter."""


class SpawnTarget(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """*What* to start: one incarnation of an actor class, its arguments encoded.

    Attributes:
        actor: ``module:QualName`` of the actor class.
        main: How to re-import ``__main__`` when the class lives there: a module name
            (``-m`` runs) or a script path, else ''.
        name: The actor's name.
        incarnation: Which incarnation of that name this is (its starter counts them).
        args: Each positional argument of its constructor, encoded alone.
        kwargs: Each keyword argument of its constructor, encoded alone.
    """

    actor: str
    main: str
    name: str
    incarnation: int
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]


@functools.cache
def _checked_fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """The fields of ``cls`` whose type `SpawnOptions.check` checks, with their resolved
    annotations (resolved once: ``msgspec.structs.fields`` does it again at every call, some
    100 us). Not ``start``: `check_start` checks it where it is used, naming the methods
    this platform has."""
    return tuple((f.name, f.type) for f in msgspec.structs.fields(cls) if f.name != "start")


class SpawnOptions(msgspec.Struct, frozen=True, kw_only=True):
    """*How* to start an actor: the options of ``ActorSystem.spawn`` and `ChildSpec`, declared
    here once (``spawn`` takes each as a keyword; ``ChildSpec`` is one).

    ``None`` means "as the system starting it says" (`over` fills those in).

    Attributes:
        process: Run it in its own OS process (default) or as a task in the starter's loop.
        spawn_timeout: Seconds it has to become ready.
        shutdown_timeout: Seconds it gets to stop gracefully before SIGTERM.
        stall_timeout: For a process: seconds its event loop may leave liveness probes
            unanswered (stopped, or blocked) before it is killed and reported ``Down`` with
            `Cause.UNRESPONSIVE`; ``None`` never probes.
        inherit: File descriptors its process inherits, under the same numbers (pass them to
            it as arguments too): a listening socket, one end of a socket pair. Nothing else
            crosses. (An in-process actor shares its starter's descriptors anyway.)
        start: For a process: ``"spawn"`` (a fresh interpreter) or ``"fork-server"``.
        node: Where a process runs: the name of a node of the system (on another host, over
            CURVE tcp: docs/guides/multi-host.md), or several tried in order (``""``: the
            starter's host; only a supervisor tries more than one); ``None``: here.

    Raises:
        ValueError: An option that the others rule out (``stall_timeout``, ``node`` or
            ``inherit`` across hosts without ``process``...), or a timeout that is NaN,
            negative, or 0 where a wait is needed (``spawn_timeout``, ``stall_timeout``),
            naming the knob.
    """

    process: bool = True
    spawn_timeout: float | None = None
    shutdown_timeout: float | None = None
    stall_timeout: float | None = None
    inherit: tuple[int, ...] = ()
    start: StartMethod | None = None
    node: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.check("")

    def check(self, where: str) -> None:
        """Refuse options that rule each other out, and timeouts out of their bounds, each
        error starting with ``where``.

        Raises:
            TypeError: An option of another type than its own (``process="no"``,
                ``kwargs=None`` of a `ChildSpec`), naming it.
            ValueError: As the class says.
        """
        # Not checked by the constructor (msgspec checks types when it decodes only): a
        # wrong one failed later, a ChildSpec's at each of its restarts.
        for name, annotation in _checked_fields(type(self)):
            value = getattr(self, name)
            try:
                msgspec.convert(value, annotation, strict=True)
            except msgspec.ValidationError as err:
                raise TypeError(f"{where}{name}={value!r}: {err}") from None
        stall, node = self.stall_timeout, self.node
        # NaN fails every comparison: each bound is written so that it is refused too (a
        # NaN deadline raises in the event loop later, far from here, and a NaN stall
        # timeout did so in the task that probes the child, ending the whole system).
        if stall is not None and not stall > 0:
            raise ValueError(f"{where}stall_timeout={stall} must be positive (or None)")
        spawn, shutdown = self.spawn_timeout, self.shutdown_timeout
        if spawn is not None and not spawn > 0:
            raise ValueError(f"{where}spawn_timeout={spawn} must be positive (or None)")
        if shutdown is not None and not shutdown >= 0:
            raise ValueError(f"{where}shutdown_timeout={shutdown} must be 0 or more (or None)")
        if self.process:
            if node is not None and self.inherit:
                raise ValueError(f"{where}inherit= cannot cross to another host (node=...)")
            return
        if stall is not None:
            raise ValueError(
                f"{where}stall_timeout is for actor processes: an in-process actor shares its "
                "starter's event loop, so nothing could probe it (pass process=True)"
            )
        if node is not None:
            raise ValueError(f"{where}node= starts a process on another host: pass process=True")

    def options(self) -> SpawnOptions:
        """These options alone (of a `ChildSpec`, which is more)."""
        if type(self) is SpawnOptions:
            return self
        return SpawnOptions(**{f: getattr(self, f) for f in SpawnOptions.__struct_fields__})

    def over(self, defaults: SpawnOptions) -> SpawnOptions:
        """These options, each left ``None`` taken from ``defaults`` (a system's)."""
        mine = self.options()
        taken = {
            f: getattr(defaults, f)
            for f in SpawnOptions.__struct_fields__
            if getattr(mine, f) is None and getattr(defaults, f) is not None
        }
        return msgspec.structs.replace(mine, **taken) if taken else mine

    @classmethod
    def take(cls, keywords: dict[str, Any]) -> tuple[SpawnOptions, dict[str, Any]]:
        """Split ``spawn``'s keywords: the options, and the rest (the constructor's).

        Raises:
            ValueError: As the class says.
        """
        fields = cls.__struct_fields__
        options = {k: v for k, v in keywords.items() if k in fields}
        if not options:
            return _NO_OPTIONS, keywords
        if "inherit" in options:
            options["inherit"] = tuple(options["inherit"])
        rest = {k: v for k, v in keywords.items() if k not in fields}
        return cls(**options), rest


_NO_OPTIONS = SpawnOptions()


class RemoteSpawn(msgspec.Struct, array_like=True, frozen=True):
    """Start one actor on the node asked, as its own child.

    Attributes:
        target: What to start.
        how: How, its timeouts resolved by the requester (``process``, ``inherit`` and
            ``node`` are the requester's business; ``start`` ``None``: as the node starts
            its actors).
        transport: The requester's transport settings, encoded (``TransportOptions``): the
            actor gets them, bound on the node's host.
        root: The system root's reply inbox (where the actor's own ``spawn(node=...)``
            resolves node names).
    """

    target: SpawnTarget
    how: SpawnOptions
    transport: msgspec.Raw
    root: str


class RemoteSpawned(msgspec.Struct, array_like=True, frozen=True):
    """A node's answer to `RemoteSpawn`: where the actor listens, its process."""

    address: str
    pid: int


class RemoteKill(msgspec.Struct, array_like=True, frozen=True):
    """Signal one actor process of the node (a stop that escalated: SIGTERM, then SIGKILL;
    ``ActorSystem.kill``: SIGKILL with a reason)."""

    address: str
    signal: int
    reason: str = ""


# -- the one death record ---------------------------------------------------------------------


class Cause(enum.Enum):
    """Why an actor incarnation died, for code to decide on (``Down.reason`` is for people)."""

    NORMAL = "normal"
    """A graceful stop, or a zero exit status."""
    EXCEPTION = "exception"
    """It raised (on_start, a background task, ``crash``), or exited non-zero."""
    SIGNAL = "signal"
    """A signal ended its process (``Down.signal`` says which)."""
    OOM = "oom"
    """The kernel's out-of-memory killer ended its process."""
    OWNER_DIED = "owner_died"
    """The process that started it died, taking it along."""
    CANCELLED = "cancelled"
    """An in-process actor that did not stop in time was cancelled."""
    UNRESPONSIVE = "unresponsive"
    """Its process stopped answering liveness probes and was killed."""
    NOCONNECTION = "noconnection"
    """The node it ran on was lost (its process, its host or the network): whether it still
    runs is unknown, and if it does it is stopped when its node sees the loss too."""


class Down(Message):
    """Delivered to watchers when an actor incarnation has died; also the DOWN frame's body.

    Attributes:
        ref: The dead incarnation.
        cause: Why, as a value to decide on (TRANSIENT restarts skip `Cause.NORMAL`).
        reason: Why, for people: ``"normal"``, the error text, the signal, ...
        exitcode: The process exit status (negative: killed by that signal); ``None`` for an
            in-process actor.
        signal: The signal number that killed it, if any.
    """

    ref: ActorRef[Any]
    cause: Cause
    reason: str
    exitcode: int | None = None
    signal: int | None = None

    @property
    def normal(self) -> bool:
        """Whether the actor stopped cleanly (a graceful stop or a zero exit)."""
        return self.cause is Cause.NORMAL


error_decoder = msgspec.msgpack.Decoder(ErrorBody)
ready_decoder = msgspec.msgpack.Decoder(ReadyBody)
watch_decoder = msgspec.msgpack.Decoder(WatchBody)
down_decoder = msgspec.msgpack.Decoder(Down)
lookup_decoder = msgspec.msgpack.Decoder(LookupQuery)
metrics_decoder = msgspec.msgpack.Decoder(MetricsQuery)
lookup_reply_decoder = msgspec.msgpack.Decoder(LookupReply)
body_encoder = msgspec.msgpack.Encoder()
hello_decoder = msgspec.msgpack.Decoder(NodeHello)
nodes_decoder = msgspec.msgpack.Decoder(NodeList)
spawn_decoder = msgspec.msgpack.Decoder(RemoteSpawn)
spawned_decoder = msgspec.msgpack.Decoder(RemoteSpawned)
kill_decoder = msgspec.msgpack.Decoder(RemoteKill)
