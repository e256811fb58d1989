"""kvasync.serve: a reference continuous-batching engine on kvasync, with an HTTP server.

A decoder-only transformer with seeded random weights and a byte vocabulary runs over a paged KV
cache that kvasync allocates (Note [Engine scheduling] in _scheduler.py). ``open_engine`` gives
the in-process client API; ``kvasync serve`` (``create_app``) the OpenAI-compatible HTTP server.
Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client) for the HTTP part.
"""

from ._engine import Completion as Completion
from ._engine import Engine as Engine
from ._engine import EngineConfig as EngineConfig
from ._engine import EngineStats as EngineStats
from ._engine import ModelRunner as ModelRunner
from ._engine import RequestRecord as RequestRecord
from ._engine import open_engine as open_engine
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import EngineClosed as EngineClosed
from ._errors import RequestFailed as RequestFailed
from ._errors import RequestTooLarge as RequestTooLarge
from ._model import PRESETS as PRESETS
from ._model import ModelConfig as ModelConfig
from ._model import Transformer as Transformer

__all__ = [
    "PRESETS",
    "Completion",
    "DeadlineExceeded",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "ModelRunner",
    "RequestFailed",
    "RequestRecord",
    "RequestTooLarge",
    "Transformer",
    "open_engine",
]
