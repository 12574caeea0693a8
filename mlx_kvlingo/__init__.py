"""mlx-kvlingo: KV-cache translation between two language models on MLX."""

from mlx_kvlingo._platform import blas as _blas

_blas.preload()  # must run before the first `import mlx`

import typing as _typing  # noqa: E402

__version__ = "0.2.0"

# The public API, shaped as mlx-lm's (see api.py): every name below follows semantic
# versioning (see CHANGELOG.md); everything else in the package is internal. Names resolve
# lazily, so `import mlx_kvlingo` stays cheap and loads no MLX by itself.
__all__ = [
    "BusyError",
    "Conversation",
    "ConversationError",
    "GenerationResponse",
    "ReaderPolicy",
    "__version__",
    "generate",
    "load",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "stream_generate",
]

_LAZY = {name: "api" for name in __all__ if name != "__version__"}
_LAZY.update(ReaderPolicy="config")

if _typing.TYPE_CHECKING:  # static checkers see the real names
    from mlx_kvlingo.api import (
        BusyError,
        Conversation,
        ConversationError,
        GenerationResponse,
        generate,
        load,
        load_prompt_cache,
        make_prompt_cache,
        save_prompt_cache,
        stream_generate,
    )

    from .config import ReaderPolicy


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
