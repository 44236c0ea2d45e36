"""The heartbeat over tcp: pings to the processes this one depends on, and their loss.

A process keeps a heartbeat with the owners of the refs it watches and with the processes
linked to it (`Heartbeat.link`: a node's root, a root's nodes). Every eighth of the system's
``heartbeat`` it pings each of them; one silent for `LOSS_SHARE` of it is lost: the actors
it owned are dead to this process (`Cause.NOCONNECTION`), and its links are called.

The heartbeat sends through a ``notify`` callable its owner hands it, and learns the
watched owners and reports losses through the process's `Deaths`; it imports nothing of
the station that owns it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ._protocol import Cause, Header, Kind

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from ._deaths import Deaths

logger = logging.getLogger("tokenyard.heartbeat")
#: The correlation id of heartbeat pings (their answers resolve no request).
BEAT_CORR = 1
#: Heartbeat pings per ``heartbeat``.
BEATS = 8
#: A peer silent for this share of ``heartbeat`` is lost.
LOSS_SHARE = 0.8


class Heartbeat:
    """Pings the peers of one process, counts the silent ones lost, answers pings.

    Args:
        name: The process's system name, for logs.
        reply_address: This process's reply inbox (never a peer of its own).
        heartbeat: Seconds within which a silent peer is lost (`TransportOptions.heartbeat`).
        deaths: Where the owners of watched refs are read, and a loss is reported.
        notify: Sends a control frame (address, kind, body, correlation id) without waiting.
        incarnation: What tells this process from another one later at its address, sent in
            each answer to a ping (empty: nothing).
    """

    def __init__(
        self,
        name: str,
        reply_address: str,
        heartbeat: float,
        deaths: Deaths,
        notify: Callable[[str, Kind, bytes, int], None],
        incarnation: bytes = b"",
    ) -> None:
        self.name = name
        self.incarnation = incarnation
        self.reply_address = reply_address
        self.heartbeat = heartbeat
        self._deaths = deaths
        self._notify = notify
        #: The peers this process keeps a heartbeat with, by reply address: when each last
        #: answered.
        self._heard: dict[str, float] = {}
        #: The incarnation each peer first answered as: a process started again at the
        #: same address (a node restarted on its fixed port) answers as another, and the
        #: one that was there is lost, though the address answers.
        self._answered_as: dict[str, bytes] = {}
        #: Called when a linked process stops answering, by its address (`link`).
        self._links: dict[str, list[Callable[[str], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beater: asyncio.TimerHandle | None = None
        #: Called with the reply address of each process that pings this one (a node's
        #: leases, `runtime._nodes`).
        self.on_ping: Callable[[str], None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start beating on ``loop``."""
        self._loop = loop
        self._beater = loop.call_later(self.heartbeat / BEATS, self._beat)

    def close(self) -> None:
        """Stop beating."""
        self._loop = None
        if self._beater is not None:
            self._beater.cancel()

    def link(self, address: str, on_lost: Callable[[str], None]) -> None:
        """Keep a heartbeat with the process whose reply inbox is ``address`` (tcp only), and
        call ``on_lost(address)`` once if it counts as lost (`_beat`)."""
        self._links.setdefault(address, []).append(on_lost)

    def unlink(self, address: str, on_lost: Callable[[str], None] | None = None) -> None:
        """Forget `link`'s callbacks for ``address`` (only ``on_lost``, when given)."""
        if on_lost is None:
            self._links.pop(address, None)
            return
        callbacks = self._links.get(address)
        if callbacks is not None and on_lost in callbacks:
            callbacks.remove(on_lost)
            if not callbacks:
                del self._links[address]

    def pinged(self, header: Header, _: bytes) -> None:
        """Answer a PING at once, from the event loop: its answer is the proof of life."""
        if header.reply_to:
            self._notify(header.reply_to, Kind.PONG, self.incarnation, header.corr)
            if self.on_ping is not None:
                self.on_ping(header.reply_to)

    def answered_as(self, address: str) -> bytes:
        """The incarnation the peer at ``address`` first answered as (empty: none yet)."""
        return self._answered_as.get(address, b"")

    def answered(self, address: str, incarnation: bytes = b"") -> None:
        """A heartbeat ping's PONG came back from ``address``, sent by ``incarnation``."""
        if address not in self._heard:
            return
        if incarnation:
            first = self._answered_as.setdefault(address, incarnation)
            if first != incarnation:
                self._lost(
                    address,
                    f"{address} answers as another process: the one there ended "
                    "(restarted) (noconnection)",
                )
                return
        self._heard[address] = time.monotonic()

    def _beat(self) -> None:
        """Every eighth of the heartbeat: ping each owner of a watched ref and each linked
        process; one silent for `LOSS_SHARE` of it is lost (`Cause.NOCONNECTION`), so a loss
        is known within 0.925 of a heartbeat of the last answer, counting the tick (the rest
        is room for a late timer).

        A lost ping or answer costs nothing (the next goes an eighth later); only most of a
        heartbeat without any answer does. The pings go from a loop callback, never waiting.
        """
        if self._loop is None:
            return
        beat = self.heartbeat
        limit = beat * LOSS_SHARE
        self._beater = self._loop.call_later(beat / BEATS, self._beat)
        now = time.monotonic()
        peers = set(self._deaths.owners())
        peers.update(self._links)
        peers.discard(self.reply_address)
        for gone in self._heard.keys() - peers:
            del self._heard[gone]
            self._answered_as.pop(gone, None)
        for peer in peers:
            heard = self._heard.setdefault(peer, now)
            if now - heard > limit:
                self._lost(peer, f"no answer from {peer} for {now - heard:.1f} s (noconnection)")
            else:
                self._notify(peer, Kind.PING, b"", BEAT_CORR)

    def _lost(self, address: str, reason: str) -> None:
        del self._heard[address]
        self._answered_as.pop(address, None)
        logger.warning("%s: %s: its actors count as dead", self.name, reason)
        self._deaths.owner_died(address, address, Cause.NOCONNECTION, reason)
        for on_lost in self._links.pop(address, []):
            on_lost(address)
