"""What one process knows of deaths: the dead it has heard of, the refs owned elsewhere whose
deaths it asked to hear of, the local callbacks waiting for one, the other processes to tell
when an actor it owns dies, and its child processes' last words.

`Deaths` sends nothing itself: its owner hands it a ``notify`` callable (a best-effort
control frame from a loop callback) and a ``cut`` callable (fail what is pending on an
address and close the socket to it). So this module imports nothing of the process's station,
which owns a `Deaths` and would otherwise be imported back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ._context import refuse_another_systems
from ._errors import ActorDeadError
from ._protocol import Cause, Down, Kind, WatchBody, body_encoder, error_decoder
from ._ref import ActorRef

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ._context import RefLike

#: How many dead addresses a process remembers (to refuse sends to them).
_DEAD_KEPT = 100_000
#: How many other processes may watch one actor here (the oldest are forgotten first).
_SUBSCRIBERS_KEPT = 1_024
#: How many child processes' last words are kept until their monitors read them.
_WORDS_KEPT = 1_024
_encode = body_encoder.encode


class Deaths:
    """Death bookkeeping of one process: who is dead, who watches whom, who waits for what.

    Args:
        reply_address: This process's reply inbox, where other processes report deaths.
        notify: Sends a control frame (address, kind, body, correlation id) without waiting.
        cut: Called with an address when nothing more will come from there, and the
            ``Down`` of the actor that lived there (``None``: the address is a process's
            reply inbox, whose requests stay pending): the owner fails the requests pending
            on that actor and closes its socket to the address, which libzmq would otherwise
            keep reconnecting.
    """

    def __init__(
        self,
        reply_address: str,
        notify: Callable[[str, Kind, bytes, int], None],
        cut: Callable[[str, Down | None], None],
    ) -> None:
        self.reply_address = reply_address
        self._notify = notify
        self._cut = cut
        #: Known deaths, by address: the whole record, so a late watcher gets it all. The
        #: tell path reads it directly (one dict lookup when it is not empty).
        self.dead: dict[str, Down] = {}
        #: Refs owned elsewhere whose deaths this process asked to hear of, by address.
        self._watched: dict[str, ActorRef[Any]] = {}
        #: Local callbacks waiting for a death, by address.
        self._listeners: dict[str, list[Callable[[Down], None]]] = {}
        #: Other processes to tell when an actor this one owns dies, by address.
        self._subscribers: dict[str, dict[str, None]] = {}
        #: Why a child process said it is exiting, by its spawn token.
        self._last_words: dict[int, str] = {}
        #: Processes known dead (their reply inboxes), and why: what they owned is dead too,
        #: though it was not watched from here when they died.
        self._dead_owners: dict[str, str] = {}

    def check_alive(self, ref: RefLike) -> None:
        """Raise ``ActorDeadError`` if ``ref``'s incarnation is known to be dead."""
        down = self.dead.get(ref.address)
        if down is not None:
            raise ActorDeadError(
                f"actor {ref.name!r} (incarnation {ref.incarnation}) is dead: {down.reason}",
                reason=down.reason,
            )

    def is_dead(self, address: str) -> bool:
        """Whether the actor at ``address`` is known to be dead."""
        return address in self.dead

    def owners(self) -> Iterator[str]:
        """The reply addresses of the processes owning the refs watched from here."""
        return (ref.owner for ref in self._watched.values())

    def mark_dead(self, down: Down) -> None:
        """Record a death: fail every request pending on it, tell listeners and subscribers."""
        address = down.ref.address
        if address in self.dead:
            return
        self.dead[address] = down
        if len(self.dead) > _DEAD_KEPT:
            del self.dead[next(iter(self.dead))]
        self._cut(address, down)
        self._watched.pop(address, None)
        for listener in self._listeners.pop(address, []):
            listener(down)
        frame = _encode(down)
        for subscriber in self._subscribers.pop(address, {}):
            self._notify(subscriber, Kind.DOWN, frame, 0)

    def on_death(self, address: str, listener: Callable[[Down], None]) -> None:
        """Call ``listener`` once when the actor at ``address`` is known dead."""
        down = self.dead.get(address)
        if down is not None:
            listener(down)
            return
        self._listeners.setdefault(address, []).append(listener)

    def forget(self, address: str, listener: Callable[[Down], None]) -> None:
        """Undo `on_death` (a cancelled watch keeps nothing)."""
        listeners = self._listeners.get(address)
        if listeners is not None and listener in listeners:
            listeners.remove(listener)
            if not listeners:
                del self._listeners[address]

    def subscribe(self, ref: RefLike) -> None:
        """Ask the process owning ``ref`` to report its death here (once per address); an
        owner known dead cannot, and what it owned is dead already.

        Raises:
            ProtocolError: Another system open in this process owns ``ref``
                (`runtime._context.refuse_another_systems`).
        """
        owner = ref.owner
        address = ref.address
        if (
            not owner
            or owner == self.reply_address
            or address in self._watched
            or address in self.dead
        ):
            return
        refuse_another_systems(ref, self.reply_address)
        full: ActorRef[Any] = ActorRef(ref.name, address, ref.incarnation, owner)
        why = self._dead_owners.get(owner)
        if why is not None:
            self.mark_dead(Down(ref=full, cause=Cause.OWNER_DIED, reason=why))
            return
        self._watched[address] = full
        self._notify(owner, Kind.WATCH, _encode(WatchBody(full, self.reply_address)), 0)

    def owner_died(
        self,
        owner: str,
        name: str,
        cause: Cause = Cause.OWNER_DIED,
        reason: str = "",
    ) -> None:
        """A child process (whose reply inbox is ``owner``) died, or a process was lost: the
        actors it owned are dead to this process, and it can no longer report their deaths.

        The socket to its reply inbox (made to answer its asks) is closed too: libzmq would
        otherwise keep reconnecting to the dead path for as long as this process lives.
        """
        why = reason or f"its owner {name!r} died"
        if cause is Cause.OWNER_DIED:  # a process lost from view may come back; a dead one not
            self._dead_owners[owner] = why
            if len(self._dead_owners) > _DEAD_KEPT:
                del self._dead_owners[next(iter(self._dead_owners))]
        orphans = [ref for ref in self._watched.values() if ref.owner == owner]
        for orphan in orphans:
            self.mark_dead(Down(ref=orphan, cause=cause, reason=why))
        self._cut(owner, None)

    # -- frames from other processes (the reply inbox's table) ----------------------------

    def watched(self, watch: WatchBody) -> None:
        """Another process asks to hear of the death of an actor owned here (WATCH)."""
        dead = self.dead.get(watch.ref.address)
        if dead is not None:
            self._notify(watch.subscriber, Kind.DOWN, _encode(dead), 0)
            return
        subscribers = self._subscribers.setdefault(watch.ref.address, {})
        subscribers[watch.subscriber] = None
        if len(subscribers) > _SUBSCRIBERS_KEPT:
            del subscribers[next(iter(subscribers))]

    def unwatched(self, watch: WatchBody) -> None:
        """A closing process asks to be forgotten (UNWATCH)."""
        self._subscribers.get(watch.ref.address, {}).pop(watch.subscriber, None)

    def reported(self, down: Down, sender: str) -> None:
        """A DOWN from ``sender``: only the process asked may report a death, and only of
        the ref it was asked about."""
        watched = self._watched.get(down.ref.address)
        if watched is not None and sender == watched.owner:
            self.mark_dead(msgspec.structs.replace(down, ref=watched))

    def unwatch_all(self) -> None:
        """Tell every owner to forget this process (it is closing), so that an actor watched
        by many short-lived processes does not keep (and one day notify) every one of them."""
        for ref in self._watched.values():
            self._notify(ref.owner, Kind.UNWATCH, _encode(WatchBody(ref, self.reply_address)), 0)

    # -- last words of child processes ----------------------------------------------------

    def expect_last_words(self, token: int) -> None:
        """Keep the last words a child process with spawn ``token`` may send."""
        if len(self._last_words) >= _WORDS_KEPT:
            del self._last_words[next(iter(self._last_words))]
        self._last_words[token] = ""

    def last_words(self, token: int, body: bytes) -> None:
        """A child's last words after it was ready (a FAILED frame answering nothing): why
        it is about to exit, kept only if its monitor registered the token."""
        if token in self._last_words:
            err = error_decoder.decode(body)
            self._last_words[token] = f"{err.type_name}: {err.message}"

    def take_last_words(self, token: int) -> str | None:
        """The last words of the child with spawn ``token`` (``None`` when it sent none)."""
        return self._last_words.pop(token, "") or None
