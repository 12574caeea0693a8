"""Memory reuse on the CPU backend: MLX's buffer cache and glibc's malloc thresholds.

Two things make a repeated translation on the CPU fault fresh pages in instead of reusing
memory it just freed:

- MLX's CPU allocator keeps freed buffers only up to its cache limit, 32 MB by default in
  MLX 0.32 (on Metal the default is the whole memory limit). A 1024-token translation on
  the dense demo pair allocates buffers of ~24 MB each, so most go back to the system.
- What goes back to the system (and everything after `mx.clear_cache()`, which mlx-lm calls
  after each prefill chunk) is freed to glibc's malloc, which returns chunks above its mmap
  threshold (128 KB to 32 MB, adjusted at run time) to the kernel at once.

`tune` raises the first and, on glibc, the mmap and trim thresholds, so freed memory stays
mapped for the next call. Figures: mlx_kvlingo/measure/RESULTS.md, "CPU memory reuse".
Set KVLINGO_CPU_MEMORY=default to leave both as they are.
"""

from __future__ import annotations

import ctypes
import os
import sys

import mlx.core as mx

#: at most this much freed memory is kept by MLX for reuse
CACHE_CAP_BYTES = 4 << 30
#: and at most this share of the machine's memory
CACHE_MEMORY_SHARE = 1 / 8
#: glibc: chunks below this come from the heap and are reused after free (not unmapped)
MMAP_THRESHOLD = 1 << 30
#: glibc: free memory at the heap's top is returned to the kernel beyond this
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>

#: what `tune` did, for `kvlingo info`: {"cache_limit": bytes, "malloc": "tuned" | why not}
state: dict = {}


def cache_target() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(CACHE_CAP_BYTES, total * CACHE_MEMORY_SHARE))


def tune() -> dict:
    """Raise MLX's CPU cache limit to `cache_target()` (never lower it: a higher limit the
    user set stays) and set glibc's thresholds once. A no-op off the CPU backend or with
    KVLINGO_CPU_MEMORY=default. Returns `state`."""
    if mx.default_device() != mx.cpu or os.environ.get("KVLINGO_CPU_MEMORY") == "default":
        return state
    wanted = cache_target()
    previous = mx.set_cache_limit(wanted)
    if previous > wanted:
        mx.set_cache_limit(previous)
    state["cache_limit"] = max(previous, wanted)
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
