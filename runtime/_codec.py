"""Wire encoding: the frame header, control bodies and the per-mailbox decoder.

A ``tell`` travels as one frame: the msgpack body alone. Everything else (asks, replies,
control) travels as ``[header, body, *buffers]`` so a router can read the header and pass the
body on as ``msgspec.Raw`` without decoding it. A header frame starts with 0xC1, the one byte
msgpack never uses, so a receiver tells the two apart from the first byte alone and never
has to ask the socket whether more frames follow (a libzmq round trip costing microseconds).
"""

from __future__ import annotations

import enum
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ._message import Message


class Kind(enum.IntEnum):
    """What a multi-frame message is."""

    ASK = 1
    REPLY = 2
    ERROR = 3
    STOP = 4
    READY = 5
    FAILED = 6
    STATS = 7
    WATCH = 8
    DOWN = 9
    LOOKUP = 10
    FLUSH = 11


class Header(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The small typed header of a multi-frame message.

    Attributes:
        kind: What the message is.
        corr: Correlation id: an ask and its reply carry the same one.
        reply_to: Address the reply goes to ('' when none is wanted).
        sender: Name of the sending actor or system, for logs.
        body_type: ``module:QualName`` of a reply body ('' for ``None``).
        frames: How many frames follow the header (the body, then extra buffers).
        cookie: The system's secret; control frames (stop, statistics) without it are
            refused, so stray bytes can never stop an actor.
    """

    kind: Kind
    corr: int = 0
    reply_to: str = ""
    sender: str = ""
    body_type: str = ""
    frames: int = 1
    cookie: bytes = b""


#: First byte of every header frame (msgpack never emits it).
HEADER_MARK = 0xC1
HEADER_BYTE = bytes([HEADER_MARK])
#: Most frames a header may announce (body plus extra buffers).
MAX_FRAMES = 64


def encode_header(header: Header) -> bytearray:
    """The header frame: the mark byte, then the msgpack header."""
    buf = bytearray(b"\xc1")
    header_encoder.encode_into(header, buf, 1)
    return buf


def decode_header(frame: bytes) -> Header:
    """Decode a header frame (the caller has checked the mark byte)."""
    return header_decoder.decode(memoryview(frame)[1:])


#: Kinds that act on the actor itself: only accepted with the system's cookie.
CONTROL_KINDS = frozenset({Kind.STOP, Kind.STATS, Kind.LOOKUP, Kind.WATCH, Kind.DOWN})


class ErrorBody(msgspec.Struct, array_like=True, frozen=True):
    """A failure carried as data: the remote exception's type, text and traceback."""

    type_name: str
    message: str
    traceback: str


class ReadyBody(msgspec.Struct, array_like=True, frozen=True):
    """Sent by a freshly started actor once ``on_start`` has finished."""

    address: str
    pid: int
    node: str = ""


class WatchBody(msgspec.Struct, array_like=True, frozen=True):
    """Asks an actor's owning node to report its death to ``subscriber``."""

    address: str
    subscriber: str


class DownBody(msgspec.Struct, array_like=True, frozen=True):
    """An owning node's report that the actor at ``address`` died."""

    address: str
    name: str
    reason: str
    exitcode: int | None = None
    signal: int | None = None


header_encoder = msgspec.msgpack.Encoder()
header_decoder = msgspec.msgpack.Decoder(Header)
error_decoder = msgspec.msgpack.Decoder(ErrorBody)
ready_decoder = msgspec.msgpack.Decoder(ReadyBody)
watch_decoder = msgspec.msgpack.Decoder(WatchBody)
down_decoder = msgspec.msgpack.Decoder(DownBody)
body_encoder = msgspec.msgpack.Encoder()

# msgpack's first byte tells an array (fixarray 0x90-0x9f, array16 0xdc, array32 0xdd) from
# a map; msgspec cannot decode a union mixing array-like and map-like structs, so a mailbox
# accepting both keeps one decoder for each and picks by that byte.
_ARRAY_FIRST_BYTES = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


def _is_array_like(cls: type[Message]) -> bool:
    return bool(cls.__struct_config__.array_like)


class MailboxDecoder:
    """Decodes a body into one of the message types a mailbox accepts.

    Built once per mailbox from the union of its handlers' message types (msgspec's guidance:
    one decoder, reused).

    Args:
        types: The accepted message classes.

    Raises:
        TypeError: If two accepted classes share a tag.
    """

    def __init__(self, types: Iterable[type[Message]]) -> None:
        self.types = tuple(types)
        arrays = [t for t in self.types if _is_array_like(t)]
        maps = [t for t in self.types if not _is_array_like(t)]
        self._array = msgspec.msgpack.Decoder(_union(arrays)) if arrays else None
        self._map = msgspec.msgpack.Decoder(_union(maps)) if maps else None

        # One shape accepted (the common case): decode is the msgspec decoder's own method,
        # with no dispatch on the first byte (a wrong-shape frame still fails validation).
        only = self._map if self._array is None else self._array if self._map is None else None
        self.decode: Callable[[bytes | memoryview], Message] = (
            only.decode if only is not None else self._decode_either
        )

    def _decode_either(self, buf: bytes | memoryview) -> Message:
        """Decode one body, picking the array or map decoder by its first byte.

        Raises:
            msgspec.DecodeError: Undecodable bytes.
            msgspec.ValidationError: A well-formed message of a type this mailbox refuses.
        """
        decoder = self._array if buf[:1] and buf[0] in _ARRAY_FIRST_BYTES else self._map
        assert decoder is not None
        result: Message = decoder.decode(buf)
        return result


def _union(types: list[type[Message]]) -> Any:
    return reduce(or_, types) if len(types) > 1 else types[0]


def encode_spawn_value(value: object, what: str) -> bytes:
    """Encode a spawn argument, naming it when it cannot be encoded.

    Raises:
        TypeError: With the argument's name and type when msgspec cannot encode it.
    """
    try:
        return body_encoder.encode(value)
    except (TypeError, msgspec.EncodeError) as err:
        raise TypeError(f"{what} ({type(value).__name__}) is not msgspec-encodable: {err}") from err
