"""Where the workers that are vLLM's engine's clients bind (`Vllm.with_clients`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from actors import PipelineConfig, Vllm
from actors.engines import EngineClient, free_port_block


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


class TestWithClients:
    def test_attached_workers_bind_two_ports_each_from_the_given_one(self) -> None:
        spec = Vllm(handshake="tcp://10.0.0.5:5570", client_port=6000).with_clients(2, None)
        assert spec.clients == (
            EngineClient(1, "tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001"),
            EngineClient(2, "tcp://10.0.0.5:6002", "tcp://10.0.0.5:6003"),
        )

    def test_the_largest_frame_taken_from_the_engine_reaches_every_worker(self) -> None:
        spec = Vllm(handshake="tcp://h:1", client_port=6000, max_frame=1 << 20)
        assert [c.max_frame for c in spec.with_clients(3, None).clients] == [1 << 20] * 3

    @pytest.mark.parametrize("max_frame", [(64 << 10) - 1, (1 << 30) + 1])
    def test_a_largest_frame_out_of_its_bounds_is_refused(self, max_frame: int) -> None:
        with pytest.raises(ValueError, match=rf"Vllm.max_frame={max_frame}: give bytes within"):
            Vllm(model="m", max_frame=max_frame)

    def test_attached_without_a_port_a_free_block_below_the_ephemeral_range(self) -> None:
        spec = Vllm(handshake="tcp://127.0.0.1:5570").with_clients(3, None)
        ports = [int(a.rsplit(":", 1)[1]) for c in spec.clients for a in (c.input, c.output)]
        assert ports == list(range(ports[0], ports[0] + 6))
        assert ports[0] >= 10_000
        assert ports[-1] < ephemeral_low()

    def test_launched_workers_bind_unix_sockets_in_the_systems_private_directory(self) -> None:
        spec = Vllm(model="m").with_clients(2, "/tmp/tokenyard-1-ab")
        assert [c.index for c in spec.clients] == [1, 2]
        assert spec.clients[1].input == "ipc:///tmp/tokenyard-1-ab/vllm-1-in"
        assert spec.clients[1].output == "ipc:///tmp/tokenyard-1-ab/vllm-1-out"

    def test_launched_in_a_system_on_tcp_the_workers_bind_loopback_ports(self) -> None:
        spec = Vllm(model="m").with_clients(1, None)
        assert spec.clients[0].input.startswith("tcp://127.0.0.1:")

    def test_with_the_scheduler_the_one_client_no_worker_binds(self) -> None:
        spec = Vllm(model="m", direct=False)
        assert spec.with_clients(2, "/d") is spec
        with pytest.raises(ValueError, match="direct=False"):
            Vllm(model="m", direct=False, clients=(EngineClient(1, "a", "b"),))

    def test_too_many_workers_for_the_ports_left_is_refused(self) -> None:
        with pytest.raises(ValueError, match="lower client_port"):
            Vllm(handshake="tcp://h:1", client_port=65530).with_clients(4, None)

    def test_workers_on_other_nodes_cannot_be_the_engines_clients(self) -> None:
        for engine in (Vllm(model="m"), Vllm(handshake="tcp://h:1")):
            with pytest.raises(ValueError, match="worker_nodes"):
                PipelineConfig(engine=engine, worker_nodes=("other",))
        PipelineConfig(engine=Vllm(model="m", direct=False), worker_nodes=("other",))


def test_a_free_block_is_free() -> None:
    first = free_port_block("127.0.0.1", 4)
    for port in range(first, first + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
