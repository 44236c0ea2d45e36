"""The route table the detokenizer and the router share: worker incarnation -> its ref."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime import ActorRef

    from .messages import Origin, WorkerMessage


class Routes:
    """Which worker incarnation is served at which ref.

    A worker index has one live incarnation at a time: adding the route of incarnation
    ``n`` of worker ``k`` drops the routes of ``k``'s older incarnations, so output meant for
    a dead one is dropped even if the drop of its route was missed.
    """

    def __init__(self) -> None:
        self._refs: dict[Origin, ActorRef[WorkerMessage]] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, origin: object) -> bool:
        return origin in self._refs

    def get(self, origin: Origin) -> ActorRef[WorkerMessage] | None:
        """The ref of ``origin``, if it has a route."""
        return self._refs.get(origin)

    def origins(self) -> list[Origin]:
        """Every routed incarnation."""
        return list(self._refs)

    def update(self, origin: Origin, ref: ActorRef[WorkerMessage] | None) -> list[Origin]:
        """Add (``ref``) or drop (``None``) the route of ``origin``.

        Returns:
            The incarnations whose routes went: ``origin`` itself on a drop, the worker's
            older incarnations on an add.
        """
        if ref is None:
            return [origin] if self._refs.pop(origin, None) is not None else []
        older = [
            o
            for o in self._refs
            if o.worker == origin.worker and o.incarnation < origin.incarnation
        ]
        for stale in older:
            del self._refs[stale]
        self._refs[origin] = ref
        return older
