"""`kvlingo serve`: the model pair behind an OpenAI-compatible chat-completions endpoint.

One concern per module, each using only those below it:

    server    the standard library's ThreadingHTTPServer: routes, limits, API key, SSE
    worker    one generation at a time under the pair's lock, a bounded queue, `auto`, usage
    pool      held conversations matched to requests by templated token prefix (LRU)
    protocol  the OpenAI request checks, sampling keywords, response and chunk bodies

Everything model-side goes through the public API (`load`, `Conversation`), so the
server answers exactly as the library does (which model reads, what is translated).
"""

from __future__ import annotations

from mlx_kvlingo.serve.protocol import MODEL_IDS, APIError, Limits, sampling_kwargs
from mlx_kvlingo.serve.server import ServeConfig, Server

__all__ = ["MODEL_IDS", "APIError", "Limits", "ServeConfig", "Server", "sampling_kwargs"]
