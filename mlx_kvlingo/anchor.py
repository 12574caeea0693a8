"""The anchor token: the target keeps its own K/V for the conversation's first token.

Position 0 is an attention sink in most LMs: huge-norm keys/values that every later token
attends to. Its K/V depend only on the token id (nothing precedes it), so the target's own
K/V for it are computed once per (model, token id) and reused: exact at no per-prompt cost.
Translators with `native_first` are calibrated without position 0 and keep it native.
"""

from __future__ import annotations

import mlx.core as mx

_CACHE_ATTR = "_kvlingo_first_token_kv"


def first_token_kv(target, token: int) -> tuple[list, list]:
    """The target's native (keys, values) per layer for `token` at position 0, memoized."""
    memo = target.__dict__.setdefault(_CACHE_ATTR, {})
    if token not in memo:
        from .decode import new_cache

        cache = new_cache(target)
        target.model(mx.array([[token]]), cache=cache)
        memo[token] = (
            [c.keys[..., :1, :] for c in cache],
            [c.values[..., :1, :] for c in cache],
        )
        mx.eval(memo[token])
    return memo[token]


def with_native_first(target, token: int, keys: list, values: list) -> tuple[list, list]:
    """Replace position 0 of translated per-layer K/V (B, H, T, D) by the target's own."""
    k0, v0 = first_token_kv(target, token)
    B = keys[0].shape[0]
    keys = [
        mx.concatenate(
            [mx.broadcast_to(a, (B, *a.shape[1:])).astype(k.dtype), k[..., 1:, :]], axis=2
        )
        for a, k in zip(k0, keys)
    ]
    values = [
        mx.concatenate(
            [mx.broadcast_to(a, (B, *a.shape[1:])).astype(v.dtype), v[..., 1:, :]], axis=2
        )
        for a, v in zip(v0, values)
    ]
    return keys, values
