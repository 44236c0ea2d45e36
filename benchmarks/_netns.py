"""Two "hosts" on one machine: this network namespace and a second one, joined by a veth
pair (root only). A node of the system (``python -m runtime node``) runs in the second
namespace, bound to its own address; cutting the link is setting the second end down.

Used by ``python -m benchmarks multihost`` and by tests/multihost."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]


def _ip(*args: str, netns: str = "") -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Hosts:
    """Host A is this namespace at ``a``; host B is namespace ``netns`` at ``b``."""

    a: str
    b: str
    netns: str
    link_b: str

    def cut(self) -> None:
        """The network between the hosts goes away (both ends still exist)."""
        _ip("link", "set", self.link_b, "down", netns=self.netns)

    def restore(self) -> None:
        _ip("link", "set", self.link_b, "up", netns=self.netns)

    async def start_node(
        self, system: str, keys: Path, name: str = "b", *extra: str
    ) -> NodeProcess:
        """``python -m runtime node`` on host B, once it has joined ``system`` (whose loop
        must keep running meanwhile: the wait is in a thread)."""
        return await anyio.to_thread.run_sync(self._start_node, system, keys, name, extra)

    def _start_node(
        self, system: str, keys: Path, name: str, extra: tuple[str, ...]
    ) -> NodeProcess:
        node = self.launch_node(system, keys, name, *extra)
        node.wait_joined(30.0)
        return node

    def launch_node(self, system: str, keys: Path, name: str = "b", *extra: str) -> NodeProcess:
        """``python -m runtime node`` on host B, not waiting (it joins once the root is up)."""
        proc = subprocess.Popen(
            [
                "ip", "netns", "exec", self.netns,
                sys.executable, "-m", "runtime", "node", "--system", system,
                "--keys", str(keys), "--name", name, "--host", self.b, *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=None,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        return NodeProcess(proc)

    def free_port(self) -> int:
        """A tcp port free on host A now (for a root that its nodes must find)."""
        with socket.socket() as sock:
            sock.bind((self.a, 0))
            port: int = sock.getsockname()[1]
            return port


class NodeProcess:
    """A node process on host B (``ip netns exec`` execs it: the pid is the node's)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def wait_joined(self, timeout: float) -> str:
        """Its "joined" line (the node is in the root's table then)."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.kill()
                raise TimeoutError(f"the node did not join in {timeout} s")
        line = self.proc.stdout.readline().decode()
        assert " joined " in line, line
        return line

    def kill(self) -> None:
        """SIGKILL (its actors die with it: they are its children)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, its exit status, and the pipe closed."""
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


#: The start of the names of the namespaces `two_hosts` makes (the pid that made one follows).
NETNS_PREFIX = "tyhb"


def names(tag: str) -> tuple[str, str, str]:
    """The namespace, the veth end here and the veth end in it, of the run ``tag`` (its pid)."""
    return f"{NETNS_PREFIX}{tag}", f"tya{tag}", f"tyb{tag}"


def namespaces() -> list[str]:
    """The network namespaces of this machine, by name."""
    listed = subprocess.run(
        ["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    return [line.split(" ", 1)[0] for line in listed.splitlines()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True  # it runs (or another user's process has the pid: left alone too)


def sweep_orphans() -> list[str]:
    """Remove the namespaces (and the veth ends left here) that `two_hosts` made in a
    process that is gone without removing them (killed by SIGKILL, say); the names
    removed. A namespace whose maker lives, or whose name is not of this form, is left
    alone."""
    removed = []
    for name in namespaces():
        tag = name.removeprefix(NETNS_PREFIX)
        if tag == name or not tag.isdigit() or _alive(int(tag)):
            continue
        subprocess.run(["ip", "link", "del", names(tag)[1]], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        removed.append(name)
    return removed


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    """A second network namespace joined to this one by a veth pair, removed on exit
    (names and a /28 subnet from this process's pid, so that runs side by side differ);
    what a run killed before its exit left is removed first (`sweep_orphans`)."""
    sweep_orphans()
    netns, link_a, link_b = names(str(os.getpid()))
    subnet = os.getpid() % 16_000
    base = f"10.{200 + subnet // 4000}.{(subnet % 4000) // 16}.{(subnet % 16) * 16}"
    prefix, last = base.rsplit(".", 1)
    a, b = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
    _ip("netns", "add", netns)
    try:
        _ip("link", "add", link_a, "type", "veth", "peer", "name", link_b)
        _ip("link", "set", link_b, "netns", netns)
        _ip("addr", "add", f"{a}/28", "dev", link_a)
        _ip("link", "set", link_a, "up")
        _ip("addr", "add", f"{b}/28", "dev", link_b, netns=netns)
        _ip("link", "set", link_b, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        yield Hosts(a=a, b=b, netns=netns, link_b=link_b)
    finally:
        subprocess.run(["ip", "link", "del", link_a], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)
