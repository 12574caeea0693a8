"""The anchor token: the target keeps its own K/V for the conversation's first token.

Position 0 is an attention sink in most LMs: huge-norm keys/values that every later token
attends to. Its K/V depend only on the token id (nothing precedes it), so the target's own
K/V for it are computed once per (model, token id) and reused: exact at no per-prompt cost.
Translators with `native_first` are calibrated without position 0 and keep it native.
"""

from __future__ import annotations

from mlx_kvlingo.kv.cache import new_cache

import mlx.core as mx

_CACHE_ATTR = "_kvlingo_first_token_kv"


def first_token_kv(target, token: int) -> tuple[mx.array, mx.array]:
    """The target's native keys and values for `token` at position 0, stacked over layers
    as (L, 1, H, 1, D) float32; computed once per (model, token id)."""
    memo = target.__dict__.setdefault(_CACHE_ATTR, {})
    if token not in memo:
        cache = new_cache(target)
        target.model(mx.array([[token]]), cache=cache)
        keys = mx.stack([c.keys[..., :1, :] for c in cache]).astype(mx.float32)
        values = mx.stack([c.values[..., :1, :] for c in cache]).astype(mx.float32)
        mx.eval(keys, values)
        memo[token] = (keys, values)
    return memo[token]


def with_native_first(
    target, token: int, keys: mx.array, values: mx.array, token_major: bool = False
) -> tuple[mx.array, mx.array]:
    """Position 0 of stacked translated K/V, (L, B, H, T, D) or with `token_major` (L, B, T,
    H, D), replaced by the target's own. Written in place: a freshly computed array gives
    its buffer to the update, so the rest is not copied (a concatenate copied all of it)."""
    k0, v0 = first_token_kv(target, token)

    def put(first, rest):
        L, B = rest.shape[:2]
        first = first.transpose(0, 1, 3, 2, 4) if token_major else first
        first = mx.broadcast_to(first, (L, B, *first.shape[2:])).astype(rest.dtype)
        if token_major:
            rest[:, :, :1] = first
        else:
            rest[..., :1, :] = first
        return rest

    return put(k0, keys), put(v0, values)


def with_native_first_layers(target, token: int, keys: list, values: list) -> tuple[list, list]:
    """The same for per-layer lists of (B, H, T, D) arrays (methods that build layers apart)."""
    k0, v0 = first_token_kv(target, token)

    def splice(first, rest):
        first = mx.broadcast_to(first, (rest.shape[0], *first.shape[1:])).astype(rest.dtype)
        return mx.concatenate([first, rest[..., 1:, :]], axis=2)

    return [splice(a, k) for a, k in zip(k0, keys)], [splice(a, v) for a, v in zip(v0, values)]
