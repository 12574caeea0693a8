"""Memory reuse on the CPU backend: glibc's malloc keeps freed memory mapped.

glibc returns chunks above its mmap threshold (128 KB to 32 MB, adjusted at run time) and free
memory at the heap's top to the kernel at once, so the next translation of the same length
faults the same pages in again. `tune` sets the mmap threshold to 1 GB and turns trimming off:
freed memory stays mapped and serves requests of any size, at the price of the heap keeping its
high-water mark. MLX's own buffer cache (which reuses a buffer only for nearly its size) is left
as is; `kv.translator.reserve_translation_memory` maps the longest translation's memory once.
Set KVLINGO_CPU_MEMORY=default to leave malloc as it is.
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
