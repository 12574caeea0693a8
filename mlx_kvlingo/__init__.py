"""mlx-kvlingo: KV-cache translation between two language models on MLX."""

from mlx_kvlingo._platform import blas as _blas

_blas.preload()  # must run before the first `import mlx`

import typing as _typing  # noqa: E402

__version__ = "0.2.0"

# The public API: every name below follows semantic versioning (see CHANGELOG.md). Everything
# else in the package (session, pair, translator, format, calibrate, cli, ...) is internal.
# Names resolve lazily, so `import mlx_kvlingo` stays cheap and loads no MLX by itself.
__all__ = [
    "Conversation",
    "ConversationError",
    "Event",
    "MemoryUsage",
    "PolicyError",
    "ReaderPolicy",
    "Runtime",
    "RuntimeBusyError",
    "Sampling",
    "Timings",
    "__version__",
]

_LAZY = {name: "api" for name in __all__ if name != "__version__"}
_LAZY.update(PolicyError="config", ReaderPolicy="config")

if _typing.TYPE_CHECKING:  # static checkers see the real names
    from mlx_kvlingo.api import (
        Conversation,
        ConversationError,
        Event,
        MemoryUsage,
        Runtime,
        RuntimeBusyError,
        Sampling,
        Timings,
    )

    from .config import PolicyError, ReaderPolicy


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
