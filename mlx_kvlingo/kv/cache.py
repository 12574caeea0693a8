"""mlx-lm KV caches as this package uses them.

A cache is a list with one mlx-lm cache object per layer; each holds keys after k_norm and
RoPE and raw values, (B, n_kv_heads, T, head_dim). Nothing here knows about translation.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


def new_cache(model) -> list:
    """An empty mlx-lm cache for `model` (a LoadedModel): one `KVCache` per layer this process
    holds (a pipelined target holds only its own layers)."""
    return [KVCache() for _ in model.layers]


def reserve(model, cache: list, n: int) -> None:
    """Give every layer room for `n` tokens (rounded up to the cache's step) before a long
    read, so that appending up to `n` never grows it (mlx-lm's `KVCache` grows by a
    concatenate that holds the old and the new buffer at once). Layers are moved one at a
    time, values and offsets unchanged."""
    g = model.geometry
    for c in cache:
        if not isinstance(c, KVCache):
            continue
        have = 0 if c.keys is None else c.keys.shape[2]
        if have >= n:
            continue
        room = -(-n // c.step) * c.step
        B, H = (1, g.kv_heads) if c.keys is None else c.keys.shape[:2]
        dtype = model.dtype if c.keys is None else c.keys.dtype
        keys = mx.zeros((B, H, room, g.head_dim), dtype)
        values = mx.zeros((B, H, room, g.value_dim), dtype)
        if c.offset:
            keys[..., : c.offset, :] = c.keys[..., : c.offset, :]
            values[..., : c.offset, :] = c.values[..., : c.offset, :]
        c.keys, c.values = keys, values
        mx.eval(c.keys, c.values)


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


def append_zeros(cache: list, n: int) -> None:
    """Append `n` zero positions to every layer of `cache`, to be overwritten before anything
    attends to them (`read_positions`)."""

    def zeros(a: mx.array) -> mx.array:
        return mx.zeros((*a.shape[:2], n, a.shape[-1]), dtype=a.dtype)

    append_kv(cache, [zeros(c.keys) for c in cache], [zeros(c.values) for c in cache])
