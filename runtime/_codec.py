"""Message encoding: the per-mailbox decoder of an actor's accepted union, and spawn values.

The frame layout and the control bodies are the protocol's (`runtime._protocol`).
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ._message import Message


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


_spawn_encoder = msgspec.msgpack.Encoder()


def encode_spawn_value(value: object, what: str) -> bytes:
    """Encode a spawn argument, naming it when it cannot be encoded.

    Raises:
        TypeError: With the argument's name and type when msgspec cannot encode it: a type
            it does not know, an int outside 64 bits, or nesting deeper than the
            interpreter's recursion limit.
    """
    try:
        return _spawn_encoder.encode(value)
    except (TypeError, msgspec.EncodeError, OverflowError, RecursionError) as err:
        raise TypeError(f"{what} ({type(value).__name__}) is not msgspec-encodable: {err}") from err
