"""llama.cpp's own HTTP server, the engines suite's baseline front end: ``python -m
benchmarks._llamacpp_server --model GGUF [--n-parallel N] [--context N] [--threads N]``.

It starts ``xllamacpp.Server(CommonParams)``, which is llama.cpp's ``llama-server`` compiled
into a Python extension: its HTTP server (cpp-httplib, a thread per connection from a
pool), its task queue and its decoding loop, all in C++ threads of this process. The
settings are those of tokenyard's llama.cpp engine (`actors._llamacpp.LlamaCppServer`): the
same slots (``n_parallel``), the same context per slot (``n_ctx`` is the whole KV cache:
``context * n_parallel``), the same compute threads, ``ctx_shift`` off; everything else is
llama-server's default (its HTTP threads too), and no API key.

**Which thread computes.** llama.cpp names none of its threads (each is ``python``, the
name it inherits), so this process names them: once the server is up it generates one
probe completion in-process (``Server.handle_completions``, no HTTP: the calling thread
tokenizes and waits, the server's loop decodes), reads every thread's run time from
``/proc/self/task/TID/schedstat`` before and after, and renames each thread that ran for
it, the main thread aside, ``llama-engine`` (``/proc/self/task/TID/comm``). With one compute
thread that is the server's loop thread: it decodes, samples and turns each token into
text. Every other thread (the HTTP pool, its listener, the log) is the front end.

It prints ``ready <url> <tid>,...`` (the engine threads) once it serves, then serves until
SIGTERM or SIGINT, then frees the server and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ._proc import die_with_parent

#: The name given to llama.cpp's compute threads (at most 15 bytes: the kernel's limit).
ENGINE_THREAD = "llama-engine"
#: Tokens of the probe completion: enough run time to tell the threads apart.
PROBE_TOKENS = 128


def _run_times() -> dict[int, int]:
    """Nanoseconds each thread of this process has run, from ``schedstat``."""
    out: dict[int, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out


def name_engine_threads(server: object) -> list[int]:
    """Find the threads that decode (see the module's docstring) and name them."""
    before = _run_times()
    answer = server.handle_completions(  # type: ignore[attr-defined]
        {
            "prompt": "The engines suite names its threads.",
            "max_tokens": PROBE_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    if isinstance(answer, dict) and "error" in answer:
        raise RuntimeError(f"the probe completion failed: {answer['error']}")
    after = _run_times()
    grown = {
        tid: ns - before.get(tid, 0) for tid, ns in after.items() if tid != os.getpid()
    }  # the main thread asked: it is not the engine
    top = max(grown.values(), default=0)
    if top <= 0:
        raise RuntimeError("no thread of llama.cpp ran for the probe completion")
    engine = sorted(tid for tid, ns in grown.items() if ns >= top // 4)
    for tid in engine:
        Path(f"/proc/self/task/{tid}/comm").write_text(ENGINE_THREAD)
    return engine


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._llamacpp_server")
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--n-parallel", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048, help="tokens per slot")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    opts = parser.parse_args(argv)
    die_with_parent()
    # Blocked before llama.cpp starts its threads, which inherit the mask: the signals wait
    # for sigwait below, in this thread, instead of ending the process in one of them.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = opts.model
    params.n_parallel = opts.n_parallel
    params.n_ctx = opts.context * opts.n_parallel
    params.cpuparams.n_threads = opts.threads
    params.cpuparams_batch.n_threads = opts.threads
    params.ctx_shift = False
    params.port = opts.port
    params.verbosity = 0
    server = xllamacpp.Server(params)
    engine = name_engine_threads(server)
    url = str(server.listening_address)
    sys.stdout.write(f"ready {url} {','.join(map(str, engine))}\n")
    sys.stdout.flush()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del server  # joins llama.cpp's threads
    return 0


if __name__ == "__main__":
    sys.exit(main())
