"""Memory reuse on the CPU backend: glibc's malloc thresholds, and MLX's buffer cache left as is.

What MLX frees beyond its own buffer cache (32 MB by default in MLX 0.32, and everything after
`mx.clear_cache()`, which mlx-lm calls after each prefill chunk) goes to glibc's malloc, which
returns chunks above its mmap threshold (128 KB to 32 MB, adjusted at run time) to the kernel
at once: the next translation of the same length faults the same pages in again. `tune` sets
the mmap threshold to 1 GB and turns the heap's trimming off, so freed memory stays mapped and
serves requests of any size. Memory handed back to the kernel can cost far more than a fault
to get back: on a virtual machine whose kernel reports free pages to its host, 2-3.5 ms per MB
against 0.05 for memory the process holds (`weights/experiments/fresh_memory.py`); with the heap trimmed
past 1 GB free, every 1024-token translation on the Qwen3-shaped preset paid it again (1.5-1.9 s
against 0.7 s; eval/RESULTS.md). The price: the heap keeps its high-water mark mapped for the
process's life.

MLX's own cache is not raised. It hands a buffer out again only for a request of nearly its
size, so a larger cache holds the buffers of one length while a translation of another length
faults fresh pages in (dense demo pair, with a 4 GB cache: 16,000-24,000 minor faults at each
new length, first translations at 512 and 768 tokens 1.5x their repeats; with MLX's default,
none and 1.0x; the figures in mlx_kvlingo/eval/RESULTS.md). `kv.translator.reserve_translation_memory`
maps the memory of the longest translation once, at load. Set KVLINGO_CPU_MEMORY=default to
leave malloc as it is.
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
