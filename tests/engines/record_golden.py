"""Record the golden frames: ``python -m tests.engines.record_golden`` (about a minute).

Starts a headless vLLM engine on the test model (`actors._hf_model`) from vLLM's venv,
takes it through the handshake with a plain pyzmq client built on `actors._vllm_protocol`,
runs the requests below, then kills its worker so that it sends ``ENGINE_CORE_DEAD``; every
frame each side sent is written to ``golden/frames.json`` (hex), with what it was. The
engine accepted every client frame recorded there: each request got its answer.
``test_protocol.py`` decodes the engine's frames with tokenyard's structs, and checks that
tokenyard still encodes the client's frames to the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from actors import _vllm_protocol as proto
from actors._hf_model import write_hf_model_dir
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from actors._vllm_engine import engine_command, process_tree, shared_memory_of

from ._vllm import ARGS, ENV, PYTHON, title

GOLDEN = Path(__file__).with_name("golden") / "frames.json"

#: The requests recorded (their ADD frames are rebuilt from these by the tests).
PROMPT = "The harbour of Yokohama"
ARRIVAL = 1_800_000_000.0
ENCODER = msgspec.msgpack.Encoder()


def add_request(request_id: str, prompt: list[int], **sampling: Any) -> proto.EngineCoreRequest:
    """The ADD body the recorder sends (and the tests rebuild)."""
    return proto.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=proto.EngineSampling(**sampling),
        arrival_time=ARRIVAL,
    )


def requests(prompt: list[int], stop_id: int) -> dict[str, proto.EngineCoreRequest]:
    """The recorded requests, by name."""
    eos = 2
    return {
        "greedy": add_request(
            "greedy", prompt, max_tokens=8, ignore_eos=True, all_stop_token_ids=[eos]
        ),
        "stop-id": add_request(
            "stop-id",
            prompt,
            max_tokens=8,
            stop_token_ids=[stop_id],
            eos_token_id=eos,
            all_stop_token_ids=sorted({stop_id, eos}),
        ),
        "seeded": add_request(
            "seeded",
            prompt,
            max_tokens=4,
            temperature=0.8,
            seed=7,
            eos_token_id=eos,
            all_stop_token_ids=[eos],
        ),
        "long": add_request("long", prompt, max_tokens=400, ignore_eos=True),
    }


class Recorder:
    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def add(self, name: str, sender: str, socket: str, frames: list[bytes]) -> None:
        self.frames.append(
            {"name": name, "from": sender, "socket": socket, "frames": [f.hex() for f in frames]}
        )


def main() -> int:
    prompt = load_tokenizer(DEFAULT_TOKENIZER_PATH).encode(PROMPT, add_special_tokens=False).ids
    rec = Recorder()
    ctx = zmq.Context()
    hs, inp, out = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    for sock in (hs, inp, out):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
    inp.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def endpoint(sock: zmq.Socket[bytes]) -> str:
        return bytes(sock.getsockopt(zmq.LAST_ENDPOINT)).decode()

    port = int(endpoint(hs).rsplit(":", 1)[1])
    model = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    write_hf_model_dir(model)
    engine = subprocess.Popen(
        engine_command(PYTHON, str(model), "127.0.0.1", port, ARGS),
        env={**os.environ, **ENV},
        start_new_session=True,
    )
    shm: set[Path] = set()
    try:
        return record(rec, engine, hs, inp, out, endpoint(inp), endpoint(out), prompt, shm)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        for path in shm:
            path.unlink(missing_ok=True)
        ctx.destroy(linger=0)


def record(
    rec: Recorder,
    engine: subprocess.Popen[bytes],
    hs: zmq.Socket[bytes],
    inp: zmq.Socket[bytes],
    out: zmq.Socket[bytes],
    inputs: str,
    outputs: str,
    prompt: list[int],
    shm: set[Path],
) -> int:
    def recv(sock: zmq.Socket[bytes], timeout: float) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while not sock.poll(1000):
            if engine.poll() is not None:
                raise RuntimeError(f"the engine exited with {engine.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing from the engine in {timeout} s")
        return sock.recv_multipart()

    started = time.monotonic()
    hello = recv(hs, 300)
    rec.add("hello", "engine", "handshake", hello[1:])
    identity = hello[0]
    metadata = proto.HandshakeMetadata(
        addresses=proto.EngineAddresses(inputs=[inputs], outputs=[outputs])
    )
    reply = ENCODER.encode(metadata)
    rec.add("handshake-metadata", "client", "handshake", [reply])
    hs.send_multipart([identity, reply])
    ready = recv(inp, 300)
    rec.add("ready-response", "engine", "input", ready[1:])
    status = recv(hs, 60)
    rec.add("ready", "engine", "handshake", status[1:])
    print(f"ready {time.monotonic() - started:.1f} s after the launch", file=sys.stderr)

    def run(name: str, request: proto.EngineCoreRequest) -> list[int]:
        body = ENCODER.encode(request)
        rec.add(f"add-{name}", "client", "input", [proto.ADD, body])
        inp.send_multipart([identity, proto.ADD, body])
        ids: list[int] = []
        while True:
            frames = recv(out, 60)
            rec.add(f"outputs-{name}", "engine", "output", frames)
            message = msgspec.msgpack.decode(frames[0], type=proto.EngineCoreOutputs)
            for o in message.outputs:
                ids.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    return ids

    first = run("greedy", requests(prompt, 0)["greedy"])
    stop_id = first[2]
    recorded = requests(prompt, stop_id)
    stopped = run("stop-id", recorded["stop-id"])
    assert stopped == first[: first.index(stop_id) + 1], (first, stopped)
    run("seeded", recorded["seeded"])

    utility = ENCODER.encode((0, 1, "is_sleeping", ()))
    rec.add("utility-is-sleeping", "client", "input", [proto.UTILITY, utility])
    inp.send_multipart([identity, proto.UTILITY, utility])
    while True:
        frames = recv(out, 60)
        message = msgspec.msgpack.decode(frames[0], type=proto.EngineCoreOutputs)
        if message.utility_output is not None:
            rec.add("utility-output", "engine", "output", frames)
            break

    long = ENCODER.encode(recorded["long"])
    rec.add("add-long", "client", "input", [proto.ADD, long])
    inp.send_multipart([identity, proto.ADD, long])
    rec.add("outputs-long", "engine", "output", recv(out, 60))
    abort = ENCODER.encode(["long"])
    rec.add("abort-long", "client", "input", [proto.ABORT, abort])
    inp.send_multipart([identity, proto.ABORT, abort])
    # The engine sends no finish for an abort its client asked for; a utility call's
    # answer, sent after the abort was taken, shows that nothing came after.
    utility = ENCODER.encode((0, 2, "is_sleeping", ()))
    inp.send_multipart([identity, proto.UTILITY, utility])
    while True:
        frames = recv(out, 60)
        message = msgspec.msgpack.decode(frames[0], type=proto.EngineCoreOutputs)
        if message.utility_output is not None:
            break
        assert all(o.finish_reason is None for o in message.outputs)

    shm.update(shared_memory_of(engine.pid))
    worker = next(p for p in process_tree(engine.pid)[1:] if "Worker" in title(p))
    os.kill(worker, signal.SIGKILL)
    while True:
        frames = recv(out, 120)
        if frames[0] == proto.ENGINE_CORE_DEAD:
            rec.add("engine-core-dead", "engine", "output", frames)
            break
    GOLDEN.write_text(json.dumps(rec.frames, indent=1) + "\n")
    print(f"wrote {len(rec.frames)} frames to {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
