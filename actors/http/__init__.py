"""The OpenAI-compatible HTTP layer of ``python -m actors serve``: a lean ASGI 3 application.

`OpenAIApp` serves completions, chat completions (JSON or server-sent events), models,
tokenize, detokenize and health over any `Engine`; `PipelineEngine` is the engine over an
in-process `actors.Pipeline`. Serve it with uvicorn (the ``serve`` extra)::

    async with PipelineEngine.open(workers=2) as engine:
        app = OpenAIApp(engine)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8000)).serve()
"""

from __future__ import annotations

from runtime._message import publish as _publish

from ._app import HTTPStatistics as HTTPStatistics
from ._app import OpenAIApp as OpenAIApp
from ._chat import DEFAULT_CHAT_TEMPLATE as DEFAULT_CHAT_TEMPLATE
from ._chat import ChatTemplate as ChatTemplate
from ._chat import ChatTemplateError as ChatTemplateError
from ._config import ServeConfig as ServeConfig
from ._engine import Chunk as Chunk
from ._engine import Completion as Completion
from ._engine import Engine as Engine
from ._engine import EngineError as EngineError
from ._engine import EngineUnavailableError as EngineUnavailableError
from ._pipeline_engine import PipelineEngine as PipelineEngine

__all__ = (
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "Chunk",
    "Completion",
    "Engine",
    "EngineError",
    "EngineUnavailableError",
    "HTTPStatistics",
    "OpenAIApp",
    "PipelineEngine",
    "ServeConfig",
)

_publish(__name__, globals(), __all__)
