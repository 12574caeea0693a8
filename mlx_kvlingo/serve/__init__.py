"""`kvlingo serve`: the pair behind an OpenAI-compatible chat-completions endpoint, over the public
API (`load`, `Conversation`): server (HTTP) -> worker (one generation at a time) -> pool (prefix
reuse) -> protocol (request checks, response bodies).
"""

from __future__ import annotations

from mlx_kvlingo.serve.protocol import MODEL_IDS, APIError, Limits, sampling_kwargs
from mlx_kvlingo.serve.server import Server
from mlx_kvlingo.serve.worker import ServeConfig

__all__ = ["MODEL_IDS", "APIError", "Limits", "ServeConfig", "Server", "sampling_kwargs"]
