"""``python -m actors``: the main job (``make run``); ``python -m actors serve``: the server;
``python -m actors load``: a streaming load against a server; ``python -m actors make-model
DIR``: the tiny llama.cpp test model; ``python -m actors make-hf-model DIR``: the tiny vLLM
test model.

``python -m actors [options]`` runs the main job (`actors._main_job`); ``python -m actors
serve [options]`` runs the OpenAI-compatible server (`actors.http._serve`) until SIGINT,
SIGTERM or SIGHUP; ``python -m actors load --url URL`` drives closed-loop streaming clients
against an OpenAI-compatible server and prints what they measured (`actors.http.load`);
``python -m actors make-model DIR`` writes a random-weight GGUF and its
tokenizer into ``DIR`` (`actors._gguf`, the ``llamacpp`` extra); ``python -m actors
make-hf-model DIR`` writes a weightless Hugging Face config and the tokenizer, which vLLM
runs with random weights (`actors._hf_model`). ``--help`` after any says more.
"""

from __future__ import annotations

import sys

from ._stop_signals import release


def main(argv: list[str] | None = None) -> int:
    """Run the main job, or ``serve``, ``load``, ``make-model`` or ``make-hf-model`` when
    that is the first argument."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["load"], ["make-model"], ["make-hf-model"]):
        # Commands that do not watch for the stop signals themselves: Python's behaviour
        # back (the package held them until now; `actors._stop_signals`).
        release()
    if args[:1] == ["serve"]:
        from .http._serve import main as serve

        return serve(args[1:])
    if args[:1] == ["load"]:
        from .http.load import main as load

        return load(args[1:])
    if args[:1] == ["make-model"]:
        from ._gguf import main as make_model

        return make_model(args[1:])
    if args[:1] == ["make-hf-model"]:
        from ._hf_model import main as make_hf_model

        return make_hf_model(args[1:])
    from ._main_job import main as main_job

    return main_job(args)


if __name__ == "__main__":
    sys.exit(main())
