"""mlx-lm KV caches as this package uses them: build, append translated K/V, copy a prefix.

A cache is a list with one mlx-lm cache object per layer; each holds keys after k_norm and
RoPE and raw values, (B, n_kv_heads, T, head_dim). Nothing here knows about translation or
generation: the translation layer and the conversation both build on it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache


def new_cache(
    model,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    max_kv_size=None,
) -> list:
    """An empty mlx-lm cache for `model` (a LoadedModel): plain, quantized (`kv_bits`) or rotating.

    One entry per layer this process holds (a pipelined target holds only its own layers)."""
    n = len(model.layers)
    if kv_bits is not None:
        D = model.geometry.head_dim
        if kv_group_size is None:
            kv_group_size = next((g for g in (64, 32) if D % g == 0), None)
        if kv_group_size is None or D % kv_group_size:
            raise ValueError(f"quantized KV needs a head dim divisible by 32 or 64 (have {D})")
        return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) for _ in range(n)]
    if max_kv_size is not None:
        return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(n)]
    return [KVCache() for _ in range(n)]


def append_kv(cache: list, keys: list, values: list) -> None:
    """Append translated K/V (per layer, (B, H, T, D)) at the cache's current end."""
    for c, k, v in zip(cache, keys, values, strict=True):
        c.update_and_fetch(k, v)
    mx.eval([(c.keys, c.values) for c in cache])


def prefix_copy(cache: list, n: int) -> list:
    """Exact-length copies of the first n positions of a cache (new arrays, same values)."""
    out = []
    for c in cache:
        k = KVCache()
        if n:
            k.keys = c.keys[..., :n, :]
            k.values = c.values[..., :n, :]
            k.offset = n
        out.append(k)
    return out
