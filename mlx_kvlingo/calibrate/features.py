"""Paired K/V traces: source and target read the same tokens; both sides at the file's key cut."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..capture import SpanKV, prefill
from ..decode import new_cache


def trace(model, tokens, cut: str) -> SpanKV:
    """RoPE-free K/V of `tokens` for every layer of `model` (a LoadedModel)."""
    return prefill(model, list(tokens), new_cache(model), cut=cut)


def layer_features(span: SpanKV, kind: str) -> np.ndarray:
    """(L, T, H*D) float32 numpy: one row per token, heads concatenated, batch 0."""
    x = span.keys if kind == "key" else span.values
    L, B, H, T, D = x.shape
    x = x[:, 0].transpose(0, 2, 1, 3).reshape(L, T, H * D)
    return np.array(x if x.dtype == mx.float64 else x.astype(mx.float32), copy=False)
