"""The pipeline with its tokenizer workers on another host (a node in a second network
namespace): it streams as a local one does and survives a remote worker's kill under load."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest

from actors import Pipeline
from tests.pipeline.test_pipeline import PROMPTS, TOKENIZER, load_with_a_kill

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from .conftest import Hosts, NodeProcess

pytestmark = pytest.mark.timeout(120)

#: Longer than the node tests': 500 requests started at once keep the caller's loop busy,
#: and a loop that leaves its heartbeat pings unsent for 0.6 of it has its remote workers
#: ended by their node's lease (as it should: it cannot be told from a lost caller).
HEARTBEAT = 3.0


@asynccontextmanager
async def remote_pipeline(
    hosts: Hosts, tmp_path: Path, worker_nodes: tuple[str, ...], step_time: float
) -> AsyncIterator[tuple[Pipeline, NodeProcess]]:
    """A 2-worker pipeline rooted on host A whose workers go to ``worker_nodes``, with
    node b on host B (it joins once the root is up: the root's port is chosen first)."""
    keys = tmp_path / "keys"
    port = hosts.free_port()
    node = hosts.launch_node(f"tcp://{hosts.a}:{port}", keys, "b", "--heartbeat", str(HEARTBEAT))
    try:
        async with Pipeline(
            workers=2,
            step_time=step_time,
            worker_nodes=worker_nodes,
            system_options={
                "transport": "tcp", "tcp_host": hosts.a, "keys": keys, "port": port,
                "heartbeat": HEARTBEAT,
            },
        ) as p:  # fmt: skip
            yield p, node
    finally:
        node.stop()


async def test_remote_workers_stream_and_a_remote_worker_killed_under_load_loses_nothing(
    hosts: Hosts, tmp_path: Path
) -> None:
    async with remote_pipeline(hosts, tmp_path, ("b",), 0.005) as (p, _station):
        workers = [await p.wait_worker(k) for k in range(2)]
        assert all(w.address.startswith(f"tcp://{hosts.b}:") for w in workers)
        assert [p.system.node_of(w) for w in workers] == ["b", "b"]
        pieces = [piece async for piece in p.stream(PROMPTS[2], max_new_tokens=24)]
        whole = await p.generate(PROMPTS[2], max_new_tokens=24)
        assert "".join(pieces) == whole.text == TOKENIZER.decode(whole.output_ids)
        assert len(pieces) > 1
        killed: list[int] = []
        done, failed = await load_with_a_kill(
            p, lambda: killed.append(p.kill_worker(1).incarnation)
        )
        assert done + failed == 500
        assert done > 0
        back = await p.wait_worker(1, after=killed[0])
        assert back.incarnation == killed[0] + 1
        assert back.address.startswith(f"tcp://{hosts.b}:")
        result = await p.generate("after the restart", max_new_tokens=8)
        assert result.completion_tokens == 8


async def test_the_workers_node_lost_under_load_leaves_no_caller_waiting_and_they_move(
    hosts: Hosts, tmp_path: Path
) -> None:
    async with remote_pipeline(hosts, tmp_path, ("b", ""), 0.002) as (p, node):
        first = [await p.wait_worker(k) for k in range(2)]
        # Round robin: worker 0 on b, worker 1 here.
        assert [p.system.node_of(w) for w in first] == ["b", None]
        done, failed = await load_with_a_kill(p, node.kill)
        assert done + failed == 500
        assert done > 0
        moved = await p.wait_worker(0, after=first[0].incarnation)
        assert moved.address.startswith(f"tcp://{hosts.a}:")
        result = await p.generate("after the move", max_new_tokens=8)
        assert result.completion_tokens == 8
