"""Static checks of the public API's types: mypy --strict checks this file (make test), and
pytest runs it so the assertions also hold at run time."""

from __future__ import annotations

from typing import Any, assert_type

from actors import GenerateResult, Member, Pipeline, WorkerDiedError
from runtime import (
    ActorRef,
    ActorSystem,
    AskTimeoutError,
    ChildSpec,
    Down,
    MailboxStatistics,
    Restart,
    Strategy,
    TokenyardError,
    Watch,
)
from tests.unit._messages import AskSelf, BadReturn, Counter, Ping, Point, Pong


async def typed_usage(system: ActorSystem, pipeline: Pipeline) -> None:
    """Never run: mypy checks what each call returns."""
    ref = await system.spawn(Counter, name="c", process=False)
    # The ref accepts what the class declares, and an ask returns what its request names.
    assert_type(ref, ActorRef[Ping | Point | AskSelf | BadReturn])
    typed: ActorRef[Ping] = ref  # a ref accepting more serves where one accepting less does
    assert_type(await typed.tell(Ping(n=1)), None)
    assert_type(await ref.ask(Ping(n=1), timeout=1.0), Pong)
    assert_type(await ref.ask(BadReturn()), Any)
    assert_type(ref.try_tell(Point(x=1, y=2)), bool)
    assert_type(system.watch(ref), Watch)
    assert_type(await system.watch(ref), Down)
    assert_type(await system.stop(ref), Down)
    assert_type(await system.lookup("c"), ActorRef[Any])
    assert_type(await system.lookup("c", missing_ok=True), ActorRef[Any] | None)
    assert_type(await system.statistics(ref), MailboxStatistics)
    assert_type(await pipeline.generate("hi", max_new_tokens=4), GenerateResult)
    async for piece in pipeline.stream("hi"):
        assert_type(piece, str)


def test_the_public_errors_and_specs_have_the_documented_shapes() -> None:
    spec = ChildSpec(Counter, name="c", restart=Restart.TRANSIENT, process=False)
    assert spec.actor == "tests.unit._messages:Counter"
    assert spec.restart is Restart.TRANSIENT
    assert Strategy.ONE_FOR_ALL.value == "one_for_all"
    assert issubclass(WorkerDiedError, TokenyardError)
    assert issubclass(AskTimeoutError, TimeoutError)
    err = WorkerDiedError("r1", Member.WORKER, "killed by SIGKILL")
    assert_type(err.rid, str)
    assert_type(err.member, Member)
    assert (err.rid, err.member) == ("r1", Member.WORKER)
