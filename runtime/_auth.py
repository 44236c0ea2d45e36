"""Who belongs to a system: its secrets, the addresses it may connect to, and CURVE over tcp.

The trust boundary is the system. Over ipc it is the system's user: every socket file lives
in the system's private directory (mode 0700). Over tcp it is whoever holds the system's
CURVE keys: every socket is a CURVE socket, and each process that binds one answers
ZeroMQ's authentication requests (ZAP) itself, admitting only the system's own client key,
so a peer without it completes no handshake and delivers no frame. Inside the boundary, each
header carries the system's cookie (`runtime._protocol`).

A process only ever connects to addresses of its own system: an ipc path inside the
system's directory, or a tcp endpoint. Over CURVE any tcp endpoint will do, wherever it is
(the system's nodes live on other hosts): a client completes no handshake, and so sends no
frame and no cookie, unless the server proves it holds the system's secret key. Without
CURVE (a measurement set-up), only the system's own host is admitted. An address from a
message (an ask's reply address, a ref's owner) that points elsewhere is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.utils.monitor
import zmq.utils.z85

from ._throttle import Throttle

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger("tokenyard.auth")

#: The ZAP endpoint libzmq asks (RFC 27).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_IPC_NAME = re.compile(r"[A-Za-z0-9_.-]{1,80}")
#: How many judged addresses a policy remembers.
_KNOWN_KEPT = 4096
#: The characters of Z85 (ZeroMQ RFC 32), in which `Keys` are written.
_Z85 = frozenset(zmq.utils.z85.Z85CHARS)
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")


class Keys(msgspec.Struct, frozen=True):
    """A system's CURVE key pair (Z85 text, 40 characters each).

    Every member uses the one pair: as a server (its mailboxes and reply inbox) and as a
    client (its outgoing sockets), and admits only that public key.
    """

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        # A key libzmq cannot use fails far from its cause (a bind's "Invalid argument", a
        # KeyError inside Z85), and a public key that is not the secret's (another system's,
        # pasted in) completes no handshake, in silence: both are refused where they are read.
        for role, key in (("public", self.public), ("secret", self.secret)):
            if len(key) != 40 or not set(key) <= _Z85:
                raise ValueError(
                    f"its {role} key is not a CURVE key (40 characters of Z85, not "
                    f"{len(key)}): is the file truncated or edited?"
                )
        if zmq.curve_public(self.secret) != self.public:
            raise ValueError(
                "its public key is not its secret key's (another system's, or swapped): use "
                "the system's own key file, unedited"
            )

    @classmethod
    def new(cls) -> Keys:
        """A fresh key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Keys:
        """Read the pair from ``directory`` (its file named system.key), generating and writing it
        (mode 0600) when the directory holds none, so several hosts can share one.

        Raises:
            PermissionError: The key file is readable by others than its owner.
            ValueError: The file holds no key pair the system can use (truncated, edited,
                its public key not its secret's), naming the file.
        """
        path = os.path.join(os.fspath(directory), "system.key")
        try:
            info = os.stat(path)
        except FileNotFoundError:
            os.makedirs(os.fspath(directory), mode=0o700, exist_ok=True)
            keys = cls.new()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(keys))
            return keys
        if info.st_mode & 0o077:
            raise PermissionError(
                f"{path} is readable by others (mode {info.st_mode & 0o777:o}): the system's "
                "secret key must be mode 0600; chmod 600 it"
            )
        with open(path, "rb") as f:
            text = f.read()
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as err:  # __post_init__'s ValueError comes as one too
            raise ValueError(f"{path} holds no system key: {err}") from None


class AddressPolicy:
    """Which addresses a process of the system may connect to.

    Args:
        ipc_dir: The system's private directory.
        tcp_hosts: The hosts of the system's tcp endpoints (empty: ipc only).
        any_tcp: Admit a tcp endpoint on any host (CURVE: the handshake proves membership).
    """

    def __init__(
        self, ipc_dir: str, tcp_hosts: frozenset[str] = frozenset(), any_tcp: bool = False
    ) -> None:
        self.any_tcp = any_tcp
        self._ipc_prefix = f"ipc://{os.path.realpath(ipc_dir)}/" if ipc_dir else None
        self._raw_prefix = f"ipc://{ipc_dir}/" if ipc_dir else None
        self.tcp_hosts = tcp_hosts
        #: Addresses already judged (an ask's reply address is checked on every ask).
        self._known: dict[str, bool] = {}

    def allows(self, address: str) -> bool:
        """Whether ``address`` is one of the system's own."""
        verdict = self._known.get(address)
        if verdict is None:
            verdict = self._judge(address)
            if len(self._known) >= _KNOWN_KEPT:
                self._known.clear()
            self._known[address] = verdict
        return verdict

    def _judge(self, address: str) -> bool:
        if address.startswith("ipc://"):
            for prefix in (self._raw_prefix, self._ipc_prefix):
                if prefix is not None and address.startswith(prefix):
                    return _IPC_NAME.fullmatch(address[len(prefix) :]) is not None
            return False
        match = _TCP.fullmatch(address)
        if match is None or not 0 < int(match.group(2)) < 65536:
            return False
        return self.any_tcp or match.group(1).strip("[]") in self.tcp_hosts


def cookie_of(keys: Keys) -> bytes:
    """The system's cookie when it has CURVE keys: derived from the secret key, so that a
    node started on another host with the same keys carries the same cookie."""
    return hashlib.blake2b(keys.secret, digest_size=16, person=b"tokenyard-cookie").digest()


def make_server(sock: zmq.Socket[bytes], keys: Keys | None) -> None:
    """Make a binding socket a CURVE server with the system's keys (no-op for ipc)."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"tokenyard")


def make_client(sock: zmq.Socket[bytes], keys: Keys | None) -> None:
    """Make a connecting socket a CURVE client of the system's servers (no-op for ipc)."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


#: Why libzmq failed a CURVE server's handshake before asking ZAP, by its protocol error.
_BROKEN_HANDSHAKES: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: (
        "its CURVE keys are not this system's (a node given another system's system.key?)"
    ),
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "it does not use CURVE",
}


class ZapHandler:
    """Answers libzmq's authentication requests for one context: the system's key only.

    It must exist before the first CURVE server socket binds (libzmq fails handshakes when
    no handler listens), and answers from the event loop once `start` has run; requests that
    arrive before wait in its socket.

    A peer with another system's keys never gets as far as a request: its first box does
    not open with this system's key, and libzmq drops it on its own. `watch` has a server
    socket's monitor report those handshakes, and this says them on the log too.

    Args:
        ctx: The process's zmq context.
        keys: The system's keys.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: Keys) -> None:
        self._allowed = zmq.utils.z85.decode(keys.public)
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self._fd = int(self.sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self.allowed = 0
        #: Handshakes refused: a peer without the system's key (libzmq drops its frames).
        self.denied = 0
        #: Handshakes libzmq failed before a request: another system's keys, no CURVE, a
        #: handshake broken off or not finished in time (`watch`).
        self.broken = 0
        self._throttle = Throttle(logger)
        #: One throttle per reason (each of `_BROKEN_HANDSHAKES`, and 0 for the rest).
        self._broken_throttles = {reason: Throttle(logger) for reason in (0, *_BROKEN_HANDSHAKES)}
        self._monitor: zmq.Socket[bytes] | None = None
        self._monitor_fd = -1
        self._watched = ""

    def watch(self, sock: zmq.Socket[bytes], address: str) -> None:
        """Count and log the handshakes that the CURVE server ``sock`` (bound at
        ``address``) fails before any request reaches this handler."""
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor_fd = int(self._monitor.getsockopt(zmq.FD))
        self._watched = address

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer requests from ``loop`` (and any already waiting)."""
        self._loop = loop
        loop.add_reader(self._fd, self._answer)
        loop.call_soon(self._answer)
        if self._monitor is not None:
            loop.add_reader(self._monitor_fd, self._broken)
            loop.call_soon(self._broken)

    def _broken(self) -> None:
        monitor = self._monitor
        while monitor is not None and int(monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self.broken += 1
            reason = event["value"] if event["value"] in _BROKEN_HANDSHAKES else 0
            why = _BROKEN_HANDSHAKES.get(
                reason, "it broke off its handshake or did not finish it in time"
            )
            # A connection closed before its greeting is also any TCP probe or port scan,
            # and a link cut mid-handshake: said, but not as a warning.
            level = logging.WARNING if reason else logging.INFO
            self._broken_throttles[reason].log(
                level, "refused a connection to %s: %s", self._watched, why
            )

    def _answer(self) -> None:
        sock = self.sock
        while int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            version, request_id = [*request, b"", b""][:2]
            ok = len(request) >= 7 and request[5] == b"CURVE" and request[6] == self._allowed
            if ok:
                self.allowed += 1
            else:
                self.denied += 1
                address = request[3].decode(errors="replace") if len(request) > 3 else "?"
                self._throttle.warning(
                    "refused a CURVE handshake from %s: not a system key", address
                )
            status = (b"200", b"OK") if ok else (b"400", b"not a key of this system")
            sock.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        """Stop answering and close the socket."""
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            if self._monitor is not None:
                self._loop.remove_reader(self._monitor_fd)
            self._loop = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        self.sock.close(0)
