"""``Actor``, the ``@handler`` marker, and how an actor class's handlers are found and checked.

An actor class declares the messages its ref accepts (``class Echo(Actor[Ping | Stop])``).
When the class is defined, its handlers are collected by the annotation of their message
parameter (one type, or a union of types, per handler), each declared message type is
checked to have a handler, and each handler of a ``Request[R]`` is checked to return ``R``.
Running an actor is the cell's business (`runtime._cell`).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import typing
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, overload

from ._context import current_station, leave_traces
from ._message import Message, reply_type

if TYPE_CHECKING:
    import anyio.abc

    from ._mailbox import MailboxStatistics
    from ._protocol import Down
    from ._ref import ActorRef
    from ._stats import ChildRecord, SystemMetrics
    from ._watch import Watch

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=Message)
N = TypeVar("N", bound=Message)

_marked: set[Callable[..., Any]] = set()
#: Per actor class: each accepted message type -> (method name, is coroutine).
_tables: dict[type, dict[type[Message], tuple[str, bool]]] = {}


def handler(fn: F) -> F:
    """Mark a method as the handler of the message type(s) its parameter is annotated with.

    The handler may be ``async def`` or plain ``def``; its return value is the reply to an
    ``ask``. A handler of a ``Request[R]`` returns an ``R``. One handler may take a union
    (``msg: Start | Resume``).

    Example:
        >>> class Echo(Actor[Ping]):
        ...     @handler
        ...     async def echo(self, msg: Ping) -> Pong:
        ...         return Pong(n=msg.n)
    """
    _marked.add(fn)
    return fn


def handler_table(cls: type) -> dict[type[Message], tuple[str, bool]]:
    """Map each accepted message type to (method name, is coroutine), built once per class.

    Raises:
        TypeError: A handler's parameter is not annotated with Message subclasses, two
            handlers claim the same type, a handler of a ``Request[R]`` does not return
            ``R``, or a message type the class declares has no handler.
        NameError: A handler's annotation names a type that is not defined in its module
            (yet: `Actor.__init_subclass__` lets this pass, for types defined further down).
    """
    table = _tables.get(cls)
    if table is not None:
        return table
    table = {}
    for klass in reversed(cls.__mro__):
        for attr, fn in vars(klass).items():
            if isinstance(fn, (staticmethod, classmethod)) and (
                fn in _marked or fn.__func__ in _marked
            ):
                raise TypeError(
                    f"{klass.__qualname__}.{attr}: a handler is a plain method (self, msg), "
                    f"not a {type(fn).__name__}"
                )
            if not isinstance(fn, types.FunctionType) or fn not in _marked:
                continue
            # A handler redefined in a subclass handles what its own annotation says, no
            # longer what the parent's did.
            for inherited in [t for t, (name, _) in table.items() if name == attr]:
                del table[inherited]
            if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
                raise TypeError(
                    f"{klass.__qualname__}.{attr}: a handler is a def or an async def that "
                    "returns; this one yields, so calling it would only make a generator and "
                    "run none of it"
                )
            try:
                hints = typing.get_type_hints(fn, vars(inspect.getmodule(fn) or klass))
            except NameError as err:
                raise NameError(
                    f"{klass.__qualname__}.{attr}: cannot resolve its annotations ({err}) in "
                    f"module {fn.__module__}: define the types a handler names at module level "
                    "(with `from __future__ import annotations` an annotation is a string, "
                    "looked up in the module, not in a function that defined the type)",
                    name=err.name,
                ) from err
            for msg_type in _message_types(klass, attr, fn, hints):
                other = table.get(msg_type)
                if other is not None and other[0] != attr:
                    raise TypeError(
                        f"{cls.__qualname__}: handlers {other[0]!r} and {attr!r} both take "
                        f"{msg_type.__qualname__}; one message type has one handler"
                    )
                _check_reply(klass, attr, msg_type, hints)
                table[msg_type] = (attr, False)
    # Whether to await: the method the class ends up with says, which may be a subclass's
    # override of an inherited handler (``async def`` where the parent's was ``def``).
    for msg_type, (attr, _) in table.items():
        method = getattr(cls, attr)
        if not callable(method):
            raise TypeError(
                f"{cls.__qualname__}.{attr} is the handler of {msg_type.__qualname__} but is "
                f"overridden with {method!r}, which cannot be called"
            )
        table[msg_type] = (attr, inspect.iscoroutinefunction(method))
    missing = [t.__qualname__ for t in declared_messages(cls) if t not in table]
    if missing:
        raise TypeError(
            f"{cls.__qualname__} declares that it accepts {', '.join(missing)} but has no "
            "handler for it: add an @handler, or leave it out of Actor[...]"
        )
    _tables[cls] = table
    return table


def _message_types(
    klass: type, attr: str, fn: Callable[..., Any], hints: dict[str, Any]
) -> list[type[Message]]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    if len(params) != 1:
        raise TypeError(f"{klass.__qualname__}.{attr}: a handler takes exactly one message")
    if params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(
            f"{klass.__qualname__}.{attr}: the message is passed positionally; make "
            f"{params[0].name!r} a plain parameter (not keyword-only, *args or **kwargs)"
        )
    annotation = hints.get(params[0].name)
    found = _members(annotation)
    for t in found:
        origin = typing.get_origin(t)
        if isinstance(origin, type) and issubclass(origin, Message):
            name = origin.__qualname__
            raise TypeError(
                f"{klass.__qualname__}.{attr}: {t} is a generic message with its type "
                f"argument filled in, which a mailbox cannot dispatch on (a decoded message "
                f"is a {name}): take a subclass that fills it in (as class Int{name}({name}"
                f"[int])), or {name} itself"
            )
    if not found or not all(isinstance(t, type) and issubclass(t, Message) for t in found):
        raise TypeError(
            f"{klass.__qualname__}.{attr}: annotate the parameter {params[0].name!r} with the "
            f"Message subclass (or union of them) it handles (got {annotation!r})"
        )
    return found


def _members(annotation: Any) -> list[Any]:
    """The members of a union annotation (the annotation itself when it is not one)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [] if annotation is None else [annotation]


def _check_reply(klass: type, attr: str, msg_type: type[Message], hints: dict[str, Any]) -> None:
    """A handler of a ``Request[R]`` must be annotated to return ``R`` (or part of it)."""
    expected = reply_type(msg_type)
    if expected is NotImplemented or expected is Any:
        return
    if "return" not in hints:
        raise TypeError(
            f"{klass.__qualname__}.{attr} handles {msg_type.__qualname__}, a request "
            f"answered with {_name(expected)}: annotate its return type"
        )
    returned = hints["return"]
    if returned is Any or _fits(returned, expected):
        return
    raise TypeError(
        f"{klass.__qualname__}.{attr} returns {_name(returned)}, but "
        f"{msg_type.__qualname__} is a request answered with {_name(expected)}"
    )


def _fits(returned: Any, expected: Any) -> bool:
    """Whether every value of type ``returned`` is also of type ``expected``."""
    wanted = [type(None) if t is None else t for t in _members_or_none(expected)]
    for got in _members_or_none(returned):
        got = type(None) if got is None else got
        origin = typing.get_origin(got) or got
        if not any(
            w is Any
            or got == w
            or (isinstance(origin, type) and isinstance(w, type) and issubclass(origin, w))
            for w in wanted
        ):
            return False
    return True


def reply_classes(msg_type: type[Message]) -> tuple[type, ...] | None:
    """The classes a reply to ``msg_type`` may be an instance of, for a check at run time;
    ``None`` when it is not a request, or names a reply no class test can check (``Any``,
    a type variable)."""
    expected = reply_type(msg_type)
    if expected is NotImplemented or expected is Any:
        return None
    classes: list[type] = []
    for member in _members_or_none(expected):
        origin = type(None) if member is None else typing.get_origin(member) or member
        if not isinstance(origin, type):
            return None
        classes.append(origin)
    return tuple(classes)


def _members_or_none(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    return getattr(annotation, "__qualname__", None) or str(annotation)


def declared_messages(cls: type) -> list[type[Message]]:
    """The message types ``cls`` declares in ``Actor[...]`` (empty when it does not say)."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Actor):
                (arg,) = typing.get_args(base)
                return [t for t in _members(arg) if isinstance(t, type) and issubclass(t, Message)]
    return []


class SystemHandle(Protocol):
    """What an actor sees of the system it lives in (``self.system``)."""

    @property
    def name(self) -> str:
        """The system's name."""
        ...

    @property
    def closing(self) -> bool:
        """Whether the system is shutting down."""
        ...

    async def spawn(
        self, actor: type[Actor[N]], *args: Any, name: str | None = None, **kwargs: Any
    ) -> ActorRef[N]:
        """Start a child actor (``ActorSystem.spawn``: the keywords are its `SpawnOptions`
        and the constructor's), here or on a node of the system."""
        ...

    async def stop(self, ref: ActorRef[Any], timeout: float | None = None) -> Down:
        """Stop a child actor (``ActorSystem.stop``)."""
        ...

    def pid_of(self, ref: ActorRef[Any]) -> int | None:
        """The process id of a child (``ActorSystem.pid_of``)."""
        ...

    def node_of(self, ref: ActorRef[Any]) -> str | None:
        """The node a child runs on (``ActorSystem.node_of``)."""
        ...

    async def kill(self, ref: ActorRef[Any], reason: str) -> Down:
        """End a stuck child at once (``ActorSystem.kill``)."""
        ...

    def is_dead(self, ref: ActorRef[Any]) -> bool:
        """Whether this process has learned of an actor's death (``ActorSystem.is_dead``)."""
        ...

    def watch(self, ref: ActorRef[Any], *, notify: ActorRef[Down] | None = None) -> Watch:
        """Watch an actor's death (``ActorSystem.watch``)."""
        ...

    @overload
    async def lookup(
        self, name: str, *, timeout: float = ..., missing_ok: Literal[False] = ...
    ) -> ActorRef[Any]: ...

    @overload
    async def lookup(
        self, name: str, *, timeout: float = ..., missing_ok: bool
    ) -> ActorRef[Any] | None: ...

    async def lookup(
        self, name: str, *, timeout: float = 5.0, missing_ok: bool = False
    ) -> ActorRef[Any] | None:
        """The live incarnation named ``name`` (``ActorSystem.lookup``)."""
        ...

    async def statistics(self, ref: ActorRef[Any], timeout: float = 5.0) -> MailboxStatistics:
        """An actor's mailbox counters (``ActorSystem.statistics``)."""
        ...

    async def gather_metrics(self, timeout: float | None = None) -> SystemMetrics:
        """The statistics of this process and every process under it
        (``ActorSystem.gather_metrics``)."""
        ...


class Actor(Generic[M]):
    """Base class of every actor, generic in the messages its ref accepts.

    Subclasses define ``@handler`` methods and may override the async lifecycle hooks
    ``on_start`` (runs before the actor is reported ready), ``on_stop`` (runs after the last
    message was handled, on a graceful stop) and ``on_failure`` (runs when the actor dies of
    an error). While running, ``self.ref`` is the actor's own ref and ``self.system`` the
    system it lives in (spawn, watch, stop, lookup).

    Example:
        >>> class Echo(Actor[Ping]):
        ...     @handler
        ...     async def ping(self, msg: Ping) -> Pong:
        ...         return Pong(n=msg.n)
    """

    ref: ActorRef[M]
    system: SystemHandle
    _task_group: anyio.abc.TaskGroup | None = None
    _failure: Exception | None = None
    #: Runs a part of a handler unless a stop request reached the actor (set by the cell
    #: that runs it: `runtime._cell.Cell.unless_stopped`); None until one does.
    _stop_guard: Callable[[Callable[[], Awaitable[None]]], Awaitable[bool]] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A plain def failed only at the spawn, with "object NoneType can't be used in
        # 'await' expression" and no word of which hook.
        for hook in ("on_start", "on_stop", "on_failure"):
            if not inspect.iscoroutinefunction(getattr(cls, hook)):
                raise TypeError(
                    f"{cls.__qualname__}.{hook} is awaited by the runtime: make it an async def"
                )
        # Check the handlers now, so a wrong one fails where the class is written; a class
        # whose annotations name types defined further down its module is checked at its
        # first spawn instead.
        with contextlib.suppress(NameError):
            handler_table(cls)

    async def on_start(self) -> None:
        """Called once before the first message; an exception here fails the spawn."""

    async def on_stop(self) -> None:
        """Called once after the last message, on a graceful stop."""

    async def on_failure(self, error: BaseException) -> None:
        """Called once when the actor dies of ``error`` (``on_start`` raised, a background
        task raised, or ``crash``), before its watchers hear of it; ``on_stop`` does not run
        then. A handler that raises fails its message only, not the actor."""

    def _supervision(self) -> list[ChildRecord]:
        """What this actor supervises, for its statistics (a `Supervisor` says)."""
        return []

    async def stop(self) -> None:
        """Stop this actor gracefully, as if asked to: messages already queued are handled,
        ``on_stop`` runs, and the exit is normal (a transient child is not restarted)."""
        await current_station().send_stop(self.ref)

    async def _unless_stopped(self, fn: Callable[[], Awaitable[None]]) -> bool:
        """Run ``fn`` from a handler unless a stop request has reached this actor, and
        cancel it as soon as one does (`runtime._cell.Cell.unless_stopped`): a long wait in
        a handler that a stop makes pointless (a supervisor's restart) does not hold the
        stop up. Returns whether ``fn`` ran to its end."""
        if self._stop_guard is None:  # not running (built by a test of its arithmetic)
            await fn()
            return True
        return await self._stop_guard(fn)

    def crash(self, error: Exception) -> None:
        """End this actor with ``error`` as soon as the running handler returns.

        The actor stops serving without ``on_stop``; whoever watches it (its supervisor)
        gets a ``Down`` whose reason carries the error. This is how an actor fails upward.
        """

        async def fail() -> None:
            raise error

        self._failure = error
        self.start_soon(fail)

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run a background task owned by this actor (from ``on_start`` or a handler).

        It is cancelled when the actor stops; if it raises, the actor dies with that error
        and its supervisor sees the ``Down``. It starts with no trace context
        (`runtime.current_trace` is empty there), whichever message's handler started it.

        Raises:
            RuntimeError: The actor is not running.
        """
        if self._task_group is None:
            raise RuntimeError(
                f"{type(self).__qualname__} is not running: start tasks from on_start"
            )
        self._task_group.start_soon(_untraced, fn, *args, name=getattr(fn, "__qualname__", None))


async def _untraced(fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
    """Run a background task outside the trace context of the handler that started it (a
    task copies its starter's context: it would report that message's trace for ever)."""
    leave_traces()
    await fn(*args)
