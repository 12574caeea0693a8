"""The source's K/V for a span of tokens, in translation space.

Keys come out RoPE-free at one of two cuts: `post_norm` (what the cache holds, un-rotated
exactly with the model's own RoPE) or `pre_norm` (the `k_proj` output before `k_norm`,
recorded during prefill). For families without `k_norm` the two cuts coincide.

A span holds every layer, or only the layers a translator reads (`SpanKV.layers`): the
others are neither copied nor un-rotated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.rope import unrotate_layers

import mlx.core as mx
import mlx.nn as nn

KEY_CUTS = ("post_norm", "pre_norm")


@dataclass
class SpanKV:
    """K/V of tokens [start, start + T) for every layer: (L, B, H, T, D), float32; or for
    the model's layers `layers` (ascending) only, keys[i] being layer layers[i]'s."""

    keys: mx.array
    values: mx.array
    start: int
    tokens: tuple[int, ...] | None = None  # the span's token ids, when known
    layers: tuple[int, ...] | None = None  # None: every layer, in order

    @property
    def length(self) -> int:
        return self.keys.shape[3]

    @property
    def end(self) -> int:
        return self.start + self.length

    def sub(self, start: int, end: int) -> SpanKV:
        """Tokens [start, end) (absolute positions) of this span, at their true positions."""
        a, b = start - self.start, end - self.start
        tokens = self.tokens[a:b] if self.tokens else None
        return SpanKV(self.keys[..., a:b, :], self.values[..., a:b, :], start, tokens, self.layers)


def check_cut(cut: str) -> None:
    if cut not in KEY_CUTS:
        raise ValueError(f"unknown key cut {cut!r}; expected one of {KEY_CUTS}")


def needs_recording(model: Any, cut: str) -> bool:
    check_cut(cut)
    return cut == "pre_norm" and model.geometry.has_k_norm


def capture_from_cache(
    model: Any,
    cache: list,
    start: int,
    end: int,
    layers: tuple[int, ...] | None = None,
    token_major: bool = False,
) -> SpanKV:
    """Read tokens [start, end) of `layers` (default: every layer) from an mlx-lm cache and
    un-rotate the keys (post_norm cut). `token_major`: the span's arrays, (L, B, H, T, D) as
    always, are views of (L, B, T, H, D) memory, the layout a mixing map reads."""
    if end <= start:
        raise ValueError(f"empty span [{start}, {end})")
    held = range(len(cache)) if layers is None else layers
    keys, values = [], []
    for i in held:
        c = cache[i]
        if c.offset < end:
            raise ValueError(f"cache layer {i} holds {c.offset} tokens, span needs {end}")
        if type(c).__name__ == "RotatingKVCache":
            raise ValueError(
                "cannot capture from a RotatingKVCache (use a plain KVCache for the source)"
            )
        k, v = c.keys, c.values
        if hasattr(c, "bits"):  # QuantizedKVCache: dequantize
            k = mx.dequantize(*k, group_size=c.group_size, bits=c.bits)
            v = mx.dequantize(*v, group_size=c.group_size, bits=c.bits)
        keys.append(k[..., start:end, :])
        v = v[..., start:end, :]
        values.append(v.swapaxes(1, 2) if token_major else v)
    keys = unrotate_layers([model.attention(i).rope for i in held], keys, start, token_major)
    values = _float(mx.stack(values))
    values = values.swapaxes(2, 3) if token_major else values
    return SpanKV(keys, values, start, layers=None if layers is None else tuple(layers))


def _float(x: mx.array) -> mx.array:
    """float32 for translation; float64 is kept (exactness tests run models in float64)."""
    return x if x.dtype == mx.float64 else x.astype(mx.float32)


class OutputRecorder(nn.Module):
    """Stands in for a module (e.g. `k_proj`) during a prefill and keeps its outputs."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.outputs: list[mx.array] = []

    def __call__(self, x):
        y = self.inner(x)
        self.outputs.append(y)
        return y


def prefill(
    model: Any, tokens: mx.array | list[int], cache: list, cut: str = "post_norm"
) -> SpanKV:
    """Run `tokens` through the model on top of `cache` (extending it), 2,048 at a time as
    mlx-lm does, and return their K/V."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    if tokens.ndim == 1:
        tokens = tokens[None]
    start = cache[0].offset
    record = needs_recording(model, cut)
    recorders = []
    if record:
        for i in range(model.geometry.layers):
            attn = model.attention(i)
            recorders.append(OutputRecorder(attn.k_proj))
            attn.k_proj = recorders[-1]
    try:
        for s in range(0, tokens.shape[1], 2048):
            model.model(tokens[:, s : s + 2048], cache=cache)
            mx.eval([(c.keys, c.values) for c in cache])
    finally:
        for i, rec in enumerate(recorders):
            model.attention(i).k_proj = rec.inner
    span = capture_from_cache(model, cache, start, cache[0].offset)
    span.tokens = tuple(int(t) for t in tokens[0].tolist())
    if record:
        g = model.geometry
        keys = [
            mx.concatenate(r.outputs, axis=1)
            .reshape(tokens.shape[0], -1, g.kv_heads, g.head_dim)
            .transpose(0, 2, 1, 3)
            .astype(span.values.dtype)
            for r in recorders
        ]
        span = SpanKV(mx.stack(keys), span.values, start, span.tokens)
    return span


def trace(model: Any, tokens, cut: str) -> SpanKV:
    """RoPE-free K/V of `tokens` for every layer of `model`, read from an empty cache."""
    return prefill(model, list(tokens), new_cache(model), cut=cut)


def layer_features(span: SpanKV, kind: str):
    """(L, T, H*D) float32 numpy: one row per token, heads concatenated, batch 0."""
    import numpy as np

    x = span.keys if kind == "key" else span.values
    L, B, H, T, D = x.shape
    return np.array(_float(x[:, 0].transpose(0, 2, 1, 3).reshape(L, T, H * D)), copy=False)
