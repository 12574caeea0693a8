"""A larger MLX buffer cache on the CPU backend, so repeated work reuses its memory.

MLX's CPU allocator keeps freed buffers for reuse only up to its cache limit, 32 MB by
default in MLX 0.32 (on Metal the default is the whole memory limit). A translation of
1024 tokens on the dense demo pair allocates buffers of ~24 MB each, so most go back to the
system and the next call faults fresh pages in: with the limit raised, a repeated
translation took 87-91 ms against 144-151 ms, and the same-shaped GEMM 58 ms against
78-79 ms (mlx_kvlingo/measure/RESULTS.md, "The CPU buffer cache").
"""

from __future__ import annotations

import os

import mlx.core as mx

#: at most this much freed memory is kept for reuse
CAP_BYTES = 4 << 30
#: and at most this share of the machine's memory
MEMORY_SHARE = 1 / 8


def target_limit() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(CAP_BYTES, total * MEMORY_SHARE))


def raise_cpu_cache_limit() -> int | None:
    """Raise the cache limit on the CPU backend to `target_limit()`, never lower it (a limit
    the user set higher stays). Returns the limit now in force, or None off the CPU or when
    KVLINGO_CPU_CACHE_LIMIT=0 (opt out)."""
    if mx.default_device() != mx.cpu or os.environ.get("KVLINGO_CPU_CACHE_LIMIT") == "0":
        return None
    wanted = target_limit()
    previous = mx.set_cache_limit(wanted)
    if previous > wanted:
        mx.set_cache_limit(previous)
        return previous
    return wanted
