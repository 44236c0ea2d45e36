"""tokenyard's LLM front-end pipeline, built on ``runtime``: tokenizer workers, a scheduler
stand-in, a detokenizer, a router and their supervisor.

Import from here: ``from actors import Pipeline, WorkerDiedError``.
"""

from __future__ import annotations

# First: ``python -m actors`` holds its stop signals before the imports that take time.
from . import _stop_signals as _stop_signals

# isort: split
from runtime import publish as _publish

from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import PipelineBusyError as PipelineBusyError
from ._errors import PipelineClosedError as PipelineClosedError
from ._errors import RequestFailedError as RequestFailedError
from ._errors import SlowReaderError as SlowReaderError
from ._errors import WorkerDiedError as WorkerDiedError
from .detokenizer import Detokenizer as Detokenizer
from .engines import EngineSpec as EngineSpec
from .engines import LlamaCpp as LlamaCpp
from .engines import StandIn as StandIn
from .engines import Vllm as Vllm
from .messages import Member as Member
from .pipeline import GenerateResult as GenerateResult
from .pipeline import Pipeline as Pipeline
from .pipeline import PipelineInbox as PipelineInbox
from .pipeline_supervisor import PipelineConfig as PipelineConfig
from .pipeline_supervisor import PipelineSupervisor as PipelineSupervisor
from .router import Router as Router
from .scheduler import Scheduler as Scheduler
from .tokenizer_worker import TokenizerWorker as TokenizerWorker

__all__ = (
    "Detokenizer",
    "EngineSpec",
    "GenerateResult",
    "InvalidRequestError",
    "LlamaCpp",
    "Member",
    "Pipeline",
    "PipelineBusyError",
    "PipelineClosedError",
    "PipelineConfig",
    "PipelineInbox",
    "PipelineSupervisor",
    "RequestFailedError",
    "Router",
    "Scheduler",
    "SlowReaderError",
    "StandIn",
    "TokenizerWorker",
    "Vllm",
    "WorkerDiedError",
)

_publish(__name__, globals(), __all__)
