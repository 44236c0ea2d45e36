"""In-process actors: handler discovery, ask/tell semantics, misuse caught early."""

from __future__ import annotations

import asyncio
import types
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import pytest

from runtime import (
    Actor,
    ActorSystem,
    Message,
    ProtocolError,
    RemoteActorError,
    SpawnError,
    TokenyardError,
    handler,
)
from runtime._actor import handler_table
from runtime._cell import Cell

from ._messages import AskOpaque, AskSelf, BadReturn, Counter, Opaque, Other, Ping, Point, Pong

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


T = TypeVar("T")


class Box(Message, Generic[T]):
    value: T


class IntBox(Box[int]):
    pass


def _keyword_only(self: object, *, msg: Ping) -> Pong:
    return Pong(n=1)


def _star_args(self: object, *msg: Ping) -> Pong:
    return Pong(n=1)


def _star_kwargs(self: object, **msg: Ping) -> Pong:
    return Pong(n=1)


class TestHandlerDiscovery:
    def test_handlers_are_found_by_the_annotation_of_their_message(self) -> None:
        table = handler_table(Counter)
        assert table[Ping] == ("ping", True)
        assert table[Point] == ("point", False)

    def test_two_handlers_for_one_type_are_refused_where_the_class_is_defined(self) -> None:
        with pytest.raises(TypeError, match="both take Ping"):

            class Twice(Actor[Ping]):
                @handler
                def a(self, msg: Ping) -> Pong:
                    return Pong(n=1)

                @handler
                def b(self, msg: Ping) -> Pong:
                    return Pong(n=2)

    def test_a_handler_without_a_message_annotation_is_refused(self) -> None:
        with pytest.raises(TypeError, match="annotate the parameter"):

            class Untyped(Actor[Any]):
                @handler
                def a(self, msg: int) -> None: ...

    @pytest.mark.parametrize("method", [_keyword_only, _star_args, _star_kwargs])
    def test_a_handler_whose_message_is_not_positional_is_refused(
        self, method: Callable[..., Pong]
    ) -> None:
        # The cell calls fn(msg): each of these would fail (or get a tuple) for every message.
        with pytest.raises(TypeError, match="passed positionally"):
            types.new_class("Bad", (Actor[Ping],), {}, lambda ns: ns.update(a=handler(method)))

    def test_a_static_or_class_method_handler_is_refused_by_name(self) -> None:
        # Else it is silently no handler: its type is refused by the mailbox, or the class
        # is told it has no handler for a type it visibly has one for.
        with pytest.raises(TypeError, match=r"plain method .* not a staticmethod"):

            class Static(Actor[Ping]):
                @handler
                def ping(self, msg: Ping) -> Pong:
                    return Pong(n=1)

                @staticmethod
                @handler
                def point(msg: Point) -> None: ...

        with pytest.raises(TypeError, match=r"plain method .* not a classmethod"):

            class Classy(Actor[Ping]):
                @handler
                @classmethod
                def ping(cls, msg: Ping) -> Pong:
                    return Pong(n=1)

    def test_a_parameterized_generic_message_is_refused_saying_what_to_take(self) -> None:
        with pytest.raises(TypeError, match=r"Box\[int\] is a generic message .* IntBox\(Box"):

            class Boxes(Actor[Box[int]]):
                @handler
                def box(self, msg: Box[int]) -> None: ...

        class IntBoxes(Actor[IntBox]):
            @handler
            def box(self, msg: IntBox) -> None: ...

        assert set(handler_table(IntBoxes)) == {IntBox}

    def test_a_generator_handler_is_refused(self) -> None:
        # Called as fn(msg), it would only make a generator: a tell would do nothing at all.
        with pytest.raises(TypeError, match="yields"):

            class Yielding(Actor[Point]):
                @handler
                async def point(self, msg: Point) -> AsyncIterator[None]:
                    yield None

    def test_a_subclass_inherits_and_extends_handlers(self) -> None:
        class More(Counter):
            @handler
            def other(self, msg: Other) -> None: ...

        assert set(handler_table(More)) == {Ping, Point, AskSelf, BadReturn, Other}

    def test_a_handler_redefined_in_a_subclass_no_longer_takes_the_parents_type(
        self,
    ) -> None:
        # Counter.ping takes Ping; a `ping` taking Other replaces it, so Ping (declared by
        # Counter) has no handler left, instead of reaching a method written for Other.
        with pytest.raises(TypeError, match="accepts Ping but has no handler"):

            class Retyped(Counter):
                @handler
                def ping(self, msg: Other) -> None: ...  # type: ignore[override]

    def test_a_non_callable_override_of_a_handler_is_refused(self) -> None:
        with pytest.raises(TypeError, match="overridden with None"):

            class Muted(Counter):
                point = None  # type: ignore[assignment]

    def test_a_lifecycle_hook_that_is_not_async_is_refused_where_the_class_is_defined(
        self,
    ) -> None:
        # Before, the spawn failed with "object NoneType can't be used in 'await'
        # expression", naming no hook.
        with pytest.raises(TypeError, match=r"SyncStart\.on_start .* make it an async def"):

            class SyncStart(Counter):
                def on_start(self) -> None:  # type: ignore[override]
                    pass

    def test_a_class_s_mailbox_decoder_is_built_once_and_shared(self) -> None:
        # One per class: a fork server builds it before forking, and its children use it.
        decoder = Cell.decoder_for(Counter)
        assert Cell.decoder_for(Counter) is decoder
        assert decoder.decode(msgspec.msgpack.encode(Ping(n=3))) == Ping(n=3)


class TestDeclaredTypes:
    def test_one_handler_may_take_a_union_of_messages(self) -> None:
        class Either(Actor[Other | Point]):
            @handler
            def either(self, msg: Other | Point) -> None: ...

        assert handler_table(Either) == {Other: ("either", False), Point: ("either", False)}

    def test_a_request_handler_answering_another_type_is_refused_where_it_is_defined(
        self,
    ) -> None:
        with pytest.raises(TypeError, match="returns Point, but Ping is a request answered"):

            class Wrong(Actor[Ping]):
                @handler
                def ping(self, msg: Ping) -> Point:
                    return Point(x=0, y=0)

    def test_a_request_handler_must_say_what_it_returns(self) -> None:
        with pytest.raises(TypeError, match="annotate its return type"):

            class Unsaid(Actor[Ping]):
                @handler
                def ping(self, msg: Ping):  # type: ignore[no-untyped-def]
                    return Pong(n=1)

    def test_a_declared_message_without_a_handler_is_refused(self) -> None:
        with pytest.raises(TypeError, match="declares that it accepts Point but has no handler"):

            class Forgetful(Actor[Ping | Point]):
                @handler
                async def ping(self, msg: Ping) -> Pong:
                    return Pong(n=msg.n)

    def test_a_union_handler_of_requests_must_fit_each_of_their_replies(self) -> None:
        with pytest.raises(TypeError, match="AskSelf is a request answered with Pong"):

            class Mixed(Actor[BadReturn | AskSelf]):
                @handler
                def both(self, msg: BadReturn | AskSelf) -> int:
                    return 1

    async def test_an_asks_reply_is_the_type_its_request_names(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="counter", process=False)
            reply = await ref.ask(Ping(n=2))
            assert type(reply) is Pong


class TestInProcessActors:
    async def test_ask_and_tell_work_in_the_callers_loop(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="counter", process=False)
            await ref.tell(Point(x=3, y=0))
            assert await ref.ask(Ping(n=1)) == Pong(n=2)
            stats = await system.statistics(ref)
            assert (stats.received, stats.handled, stats.rejected) == (2, 2, 0)

    async def test_asking_a_message_that_is_not_a_request_says_to_tell_it(self) -> None:
        # Only mypy refused it: at run time the actor handled it and the ask returned None.
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="counter", process=False)
            with pytest.raises(TypeError, match=r"ask\(Point\) to actor 'counter'.*use tell"):
                await ref.ask(Point(x=3, y=0))  # type: ignore[arg-type] # the misuse, on purpose
            assert await ref.ask(Ping(n=1)) == Pong(n=2)
            assert (await system.statistics(ref)).received == 1  # the Point was never sent

    async def test_asking_yourself_from_a_handler_fails_instead_of_deadlocking(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="counter", process=False)
            with pytest.raises(RemoteActorError, match="asked itself"):
                await ref.ask(AskSelf(), timeout=5)

    async def test_a_handler_returning_a_non_message_is_a_protocol_error(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="counter", process=False)
            with pytest.raises(RemoteActorError) as info:
                await ref.ask(BadReturn())
            assert info.value.type_name == "runtime.ProtocolError"

    async def test_a_reply_msgspec_cannot_encode_fails_the_ask_not_the_actor(self) -> None:
        class Leaky(Actor[AskOpaque | Ping]):
            @handler
            def opaque(self, msg: AskOpaque) -> Opaque:
                return Opaque(value=object())

            @handler
            def ping(self, msg: Ping) -> Pong:
                return Pong(n=msg.n + 1)

        async with ActorSystem() as system:
            ref = await system.spawn(Leaky, process=False)
            with pytest.raises(RemoteActorError, match="cannot encode") as info:
                await ref.ask(AskOpaque(), timeout=5)
            assert info.value.type_name == "runtime.ProtocolError"
            assert await ref.ask(Ping(n=1), timeout=5) == Pong(n=2)
            assert not system.is_dead(ref)
            stats = await system.statistics(ref)
            assert (stats.failed, stats.handled) == (1, 1)  # its answer never reached the asker

    async def test_a_message_defined_in_a_function_is_named_at_spawn(self) -> None:
        # Under `from __future__ import annotations` (as here) the annotation is a string that
        # only the module's namespace can resolve: the class defines, its spawn cannot.
        class Local(Message):
            n: int

        class UsesLocal(Actor[Local]):
            @handler
            def local(self, msg: Local) -> None: ...

        async with ActorSystem() as system:
            with pytest.raises(NameError, match=r"UsesLocal\.local: .*'Local'.*module level"):
                await system.spawn(UsesLocal, process=False)

    @pytest.mark.parametrize("wrong", [Other(text="not a pong"), None])
    async def test_a_reply_of_another_type_than_the_request_names_fails_the_ask(
        self, wrong: Other | None
    ) -> None:
        # The class check reads annotations only; what the handler returns is checked when
        # it answers, so `ask` of a Request[Pong] gives a Pong or an error, never an Other.
        class Liar(Actor[Ping]):
            @handler
            def ping(self, msg: Ping) -> Pong:
                return Pong(n=msg.n) if msg.n else wrong  # type: ignore[return-value]

        async with ActorSystem() as system:
            ref = await system.spawn(Liar, process=False)
            with pytest.raises(RemoteActorError, match="a request answered with Pong") as info:
                await ref.ask(Ping(n=0), timeout=5)
            assert info.value.type_name == "runtime.ProtocolError"
            assert await ref.ask(Ping(n=1), timeout=5) == Pong(n=1)
            assert (await system.statistics(ref)).failed == 1

    async def test_a_cancelled_error_a_handler_raises_unasked_fails_its_message_only(
        self,
    ) -> None:
        # asyncio raises CancelledError in whoever awaits a task or future cancelled by
        # someone else: not this actor's cancellation. It was taken for one: the actor
        # ended as "cancelled with its system's task" (logged as the host's own doing),
        # and its asker got ActorDeadError.
        async def cancelled_elsewhere() -> None:
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future

        class Unlucky(Actor[Ping | Point]):
            @handler
            async def ping(self, msg: Ping) -> Pong:
                if not msg.n:
                    await cancelled_elsewhere()
                return Pong(n=msg.n)

            @handler
            async def point(self, msg: Point) -> None:
                await cancelled_elsewhere()

        async with ActorSystem() as system:
            ref = await system.spawn(Unlucky, process=False)
            with pytest.raises(RemoteActorError) as info:
                await ref.ask(Ping(n=0), timeout=5)
            assert info.value.type_name.endswith("CancelledError")
            await ref.tell(Point(x=0, y=0))
            assert await ref.ask(Ping(n=1), timeout=5) == Pong(n=1)
            assert not system.is_dead(ref)
            assert (await system.statistics(ref)).failed == 2

    async def test_a_message_msgspec_cannot_encode_is_refused_naming_its_type(self) -> None:
        async with ActorSystem() as system:
            ref: Any = await system.spawn(Counter, process=False)
            with pytest.raises(TypeError, match=r"Opaque cannot be sent: .*object"):
                await ref.tell(Opaque(value=object()))
            with pytest.raises(TypeError, match=r"Opaque cannot be sent"):
                ref.try_tell(Opaque(value=object()))
            with pytest.raises(TypeError, match=r"Ping cannot be sent: .*2\*\*64"):
                await ref.ask(Ping(n=2**70), timeout=5)
            assert await ref.ask(Ping(n=1), timeout=5) == Pong(n=2)

    async def test_an_override_of_a_handler_is_awaited_if_it_is_async(self) -> None:
        # Counter.point is a plain def and Counter.ping an async def; overrides without
        # @handler swap them, and each must still run (not be left un-awaited, or awaited
        # when it returned None).
        class Swapped(Counter):
            async def point(self, msg: Point) -> None:  # type: ignore[override]
                self.seen.append(-1)

            def ping(self, msg: Ping) -> Pong:  # type: ignore[override]
                self.seen.append(msg.n)
                return Pong(n=msg.n * 10)

        async with ActorSystem() as system:
            ref = await system.spawn(Swapped, process=False)
            await ref.tell(Point(x=3, y=0))
            assert await ref.ask(Ping(n=1), timeout=5) == Pong(n=10)
            stats = await system.statistics(ref)
            assert (stats.handled, stats.failed) == (2, 0)

    async def test_an_actor_without_handlers_cannot_be_spawned(self) -> None:
        class Mute(Actor[Any]):
            pass

        async with ActorSystem() as system:
            with pytest.raises(TypeError, match="no @handler"):
                await system.spawn(Mute, process=False)

    async def test_a_class_defined_in_a_function_cannot_go_to_a_process(self) -> None:
        class Local(Counter):
            pass

        async with ActorSystem() as system:
            with pytest.raises(SpawnError, match="inside a function"):
                await system.spawn(Local)

    async def test_an_in_process_on_start_failure_is_a_spawn_error(self) -> None:
        class Grumpy(Counter):
            async def on_start(self) -> None:
                raise RuntimeError("nope")

        async with ActorSystem() as system:
            with pytest.raises(SpawnError, match="nope"):
                await system.spawn(Grumpy, process=False)


class TestOutsideASystem:
    async def test_sending_without_an_open_system_says_how_to_open_one(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, process=False)
        with pytest.raises(TokenyardError, match="async with ActorSystem"):
            await ref.tell(Ping(n=1))

    def test_protocol_error_is_a_tokenyard_error(self) -> None:
        assert issubclass(ProtocolError, TokenyardError)
