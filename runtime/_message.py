"""The base class of every message."""

from __future__ import annotations

import sys
import typing
from typing import Any, Generic, TypeVar

import msgspec

#: The one tag field every message carries on the wire.
TAG_FIELD = "type"


#: Every Message subclass imported in this process, by ``module:QualName``: a reply names
#: its type by that path and the asker decodes it with the class found here.
registry: dict[str, type[Message]] = {}


def type_path(cls: type) -> str:
    """Return ``module:QualName``, the import path a class travels by.

    A child process re-imports a script's ``__main__`` as ``__mp_main__``; both spell
    ``__main__`` so a type keeps one path on both sides.
    """
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return f"{module}:{cls.__qualname__}"


class MessageMeta(msgspec.StructMeta):
    """Makes ``kw_only`` the default of every message class, not only of ``Message``.

    msgspec applies ``kw_only`` to the fields of the class that sets it; without this, a
    subclass declaring a required field after an inherited default would not define.
    """

    def __new__(
        mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any
    ) -> MessageMeta:
        kwargs.setdefault("kw_only", True)
        cls: MessageMeta = super().__new__(mcls, name, bases, namespace, **kwargs)
        return cls


class Message(msgspec.Struct, tag=True, kw_only=True, tag_field=TAG_FIELD, metaclass=MessageMeta):
    """Base class of every message an actor accepts.

    Subclasses are ``msgspec.Struct`` types tagged by class name, so a mailbox can decode the
    union of the types its handlers accept in one pass. Hot-path messages may pass
    ``array_like=True``; new fields go last with a default so old peers still decode them.

    Example:
        >>> class Ping(Message):
        ...     n: int
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        registry[type_path(cls)] = cls


#: Covariant: a request answered with a ``Pong`` is one answered with an ``object``.
R = TypeVar("R", covariant=True)


class Request(Message, Generic[R]):
    """A message that is asked, naming the type of its reply.

    ``ActorRef.ask`` of a ``Request[R]`` returns an ``R``, and the actor class that handles
    it is checked, when it is defined, to annotate its handler as returning ``R``. A request
    answered with nothing is a ``Request[None]``.

    Example:
        >>> class Pong(Message):
        ...     n: int
        >>> class Ping(Request[Pong]):
        ...     n: int
    """


def reply_type(cls: type[Message]) -> Any:
    """The reply type a ``Request`` subclass names (``R`` of ``Request[R]``), or
    ``NotImplemented`` when ``cls`` is not a request (or does not say).

    A reply type named by a string (``Request["Pong"]``, for a class defined further down)
    is looked up in the module of the request.

    Raises:
        NameError: The string names nothing (yet) in that module.
    """
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = getattr(base, "__origin__", None)
            if isinstance(origin, type) and issubclass(origin, Request):
                (arg,) = base.__args__
                if isinstance(arg, typing.ForwardRef):
                    namespace = vars(sys.modules[klass.__module__])
                    arg = eval(arg.__forward_arg__, namespace)  # noqa: S307 - a type annotation
                return arg
    return NotImplemented


def publish(package: str, namespace: dict[str, object], names: tuple[str, ...]) -> None:
    """Report re-exported classes as living in ``package``, so tracebacks read
    ``runtime.ActorDeadError``.

    msgspec structs keep their defining module: msgspec resolves their annotations in that
    module's namespace, and their import path is also their name on the wire.
    """
    for name in names:
        obj = namespace[name]
        if (
            isinstance(obj, type)
            and obj.__module__.startswith(package + ".")
            and not issubclass(obj, msgspec.Struct)
        ):
            obj.__module__ = package
