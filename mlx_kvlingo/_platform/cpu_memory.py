"""Memory reuse on the CPU backend: `tune` sets glibc's mmap threshold to 1 GB and turns heap
trimming off, so freed memory stays mapped and the next translation does not fault its pages
in again (the heap keeps its high-water mark). KVLINGO_CPU_MEMORY=default leaves malloc as is.
"""

from __future__ import annotations

import ctypes
import os
import sys

import mlx.core as mx

#: glibc: chunks below this come from the heap and are reused after free (not unmapped)
MMAP_THRESHOLD = 1 << 30
#: glibc: free memory at the heap's top is returned to the kernel beyond this; -1: never
TRIM_THRESHOLD = -1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>

#: what `tune` did, for `kvlingo info`: {"cache_limit": bytes, "malloc": "tuned" | why not}
state: dict = {}


def cache_limit() -> int:
    """MLX's buffer cache limit in force (read by setting it and putting it back)."""
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


def tune() -> dict:
    """Set glibc's thresholds once (MLX's cache limit stays as MLX or the user set it). A
    no-op off the CPU backend or with KVLINGO_CPU_MEMORY=default. Returns `state`."""
    if mx.default_device() != mx.cpu or os.environ.get("KVLINGO_CPU_MEMORY") == "default":
        return state
    state["cache_limit"] = cache_limit()
    if "malloc" not in state:
        state["malloc"] = _tune_malloc()
    return state


def _tune_malloc() -> str:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError off glibc (musl)
    except (OSError, AttributeError):
        return "not glibc"
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(
        _M_TRIM_THRESHOLD, TRIM_THRESHOLD
    )
    return "tuned" if ok else "mallopt refused"
