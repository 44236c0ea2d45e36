"""The OpenAI-compatible HTTP layer of ``python -m actors serve``: a lean ASGI 3 application.

`OpenAIApp` serves completions, chat completions (JSON or server-sent events), models,
tokenize, detokenize and health over any `Engine`; `PipelineEngine` is the engine over an
in-process `actors.Pipeline`. Serve it with uvicorn (the ``serve`` extra)::

    async with PipelineEngine.open(workers=2) as engine:
        app = OpenAIApp(engine)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8000)).serve()
"""

from __future__ import annotations

from runtime import publish as _publish

from ._app import HTTPStatistics as HTTPStatistics
from ._app import OpenAIApp as OpenAIApp
from ._auth import ApiKey as ApiKey
from ._chat import DEFAULT_CHAT_TEMPLATE as DEFAULT_CHAT_TEMPLATE
from ._chat import ChatTemplate as ChatTemplate
from ._chat import ChatTemplateError as ChatTemplateError
from ._config import ServeConfig as ServeConfig
from ._dispatch import Dispatcher as Dispatcher
from ._dispatch import DispatchStatistics as DispatchStatistics
from ._engine import Chunk as Chunk
from ._engine import Completion as Completion
from ._engine import Engine as Engine
from ._engine import EngineError as EngineError
from ._engine import EngineRefusedError as EngineRefusedError
from ._engine import EngineUnavailableError as EngineUnavailableError
from ._pipeline_engine import PipelineEngine as PipelineEngine
from ._serve import Server as Server
from ._serve import open_server as open_server
from ._worker import HttpSettings as HttpSettings
from ._worker import HttpWorker as HttpWorker
from ._worker_engine import WorkerEngine as WorkerEngine

__all__ = (
    "DEFAULT_CHAT_TEMPLATE",
    "ApiKey",
    "ChatTemplate",
    "ChatTemplateError",
    "Chunk",
    "Completion",
    "DispatchStatistics",
    "Dispatcher",
    "Engine",
    "EngineError",
    "EngineRefusedError",
    "EngineUnavailableError",
    "HTTPStatistics",
    "HttpSettings",
    "HttpWorker",
    "OpenAIApp",
    "PipelineEngine",
    "ServeConfig",
    "Server",
    "WorkerEngine",
    "open_server",
)

_publish(__name__, globals(), __all__)
