"""Speculative prefill (SpecPrefill, Liu et al., ICML 2025): the peer that drops what it does
not read, as vllm-mlx 0.6.0 ships it on MLX (`vllm_mlx/specprefill.py`), written anew here.

    importance[t] = mean_s  max_(l,h)  pool13( softmax_t( q[l,h,s] . k[l,h,t] * scale ) )

The small model reads the whole prompt (M tokens), then decodes `LOOKAHEAD` = 8 steps
(sampled at temperature 0.6, top-p 0.95); q are the rotated queries of those steps in every
layer and head, k the rotated prompt keys its cache holds (a query head reads its GQA group's
key head), the softmax runs over the prompt alone, pool13 is a 13-wide moving average with
zeros past the ends (always divided by 13), the max goes over layers and heads, the mean over
the steps. `select_chunks` keeps whole 32-token chunks by their mean importance, nothing else
is always kept. The large model then reads only the kept tokens, each at its own position,
and decodes with positions going on after the whole prompt: step i at M + i while its cache
holds N + i entries (`positions_shifted`).

Positions go through each layer's own RoPE module: a prompt row at position p is rotated by
`rope(row, offset=p)` (kv/recompute.py's per-row offsets), the decode's by `rope(x, offset +
shift)`. So traditional and non-traditional layouts and every RoPE kind are rotated as the
model rotates them, and keeping every token reads the native cache bit for bit (the shipped
code rotates with its own non-traditional formula and misses a plain `nn.RoPE`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.recompute import _rope_swapped, _RowPositions

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_sampler

LOOKAHEAD = 8  # decode steps whose queries score the prompt
POOL = 13  # moving-average width over positions
CHUNK = 32  # tokens kept or dropped together
STEP = 512  # tokens per forward pass while reading (the chat's READ_CHUNK)


def _pool(x: mx.array) -> mx.array:
    """Moving average over the last axis, zeros past both ends, divided by `POOL` (odd)."""
    half = POOL // 2
    c = mx.cumsum(mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(half + 1, half)]), axis=-1)
    return (c[..., POOL:] - c[..., :-POOL]) / POOL


def score_tokens(model, tokens: Sequence[int], temp: float = 0.6,
                 cache: list | None = None) -> mx.array:  # fmt: skip
    """Each prompt token's importance to `model` (the small one) by the formula above: (M,).
    `cache`: the model's cache already holding tokens[:-1] (its read is then skipped; the
    look-ahead's entries are trimmed off again)."""
    M, x = len(tokens), mx.array(list(tokens))
    if cache is None:
        cache = new_cache(model)
        for s in range(0, M - 1, STEP):
            model.model(x[s : min(s + STEP, M - 1)][None], cache=cache)
            mx.eval([c.state for c in cache])
    elif any(c.offset != M - 1 for c in cache):
        raise ValueError(f"the cache must hold the prompt but its last token ({M - 1})")
    logits = model.model(x[M - 1 :][None], cache=cache)
    sampler = make_sampler(temp=temp, top_p=0.95)
    queries: list[list] = [[] for _ in model.layers]
    for s in range(LOOKAHEAD):
        y = sampler(logits[:, -1, :])
        row = mx.array([M + s])  # each layer's first RoPE call in a step rotates its queries
        with _ropes(model, lambda i, rope, row=row: _RowPositions(rope, row, queries[i])):
            logits = model.model(y[None], cache=cache)
        mx.eval(logits, queries)
    peak = None
    for layer, c, kept in zip(model.layers, cache, queries):
        q = mx.concatenate(kept, axis=2).astype(mx.float32)  # (1, H, S, D)
        k = c.keys[..., :M, :].astype(mx.float32)  # (1, Hkv, M, D)
        H, Hkv = q.shape[1], k.shape[1]
        q = q.reshape(Hkv, H // Hkv, LOOKAHEAD, q.shape[-1])
        w = mx.softmax((q @ k[0][:, None].swapaxes(-1, -2)) * layer.self_attn.scale, axis=-1)
        w = _pool(w.reshape(H, LOOKAHEAD, M)).max(axis=0)  # (S, M)
        peak = w if peak is None else mx.maximum(peak, w)
    importance = peak.mean(axis=0)
    mx.eval(importance)
    for c in cache:  # the prompt's entries only, as given
        c.trim(c.offset - (M - 1))
    return importance


def select_chunks(importance: mx.array, keep: float) -> list[int]:
    """The kept token indices, sorted: vllm-mlx's `select_chunks` with no backbone.

    Of the n = ceil(M / CHUNK) chunks (the last may be short), take them in descending order
    of their mean importance (ties: the earlier first) until at least keep_n = max(1,
    ceil(n * keep)) are taken and they hold at least max(1, ceil(M * keep)) tokens; keep >= 1
    keeps every token."""
    M = importance.shape[0]
    if not keep > 0:
        raise ValueError(f"the kept share must be above 0, got {keep}")
    if keep >= 1.0:
        return list(range(M))
    n = math.ceil(M / CHUNK)
    keep_n, want = max(1, math.ceil(n * keep)), max(1, math.ceil(M * keep))
    means = mx.stack([mx.mean(importance[i * CHUNK : (i + 1) * CHUNK]) for i in range(n)]).tolist()
    chosen, size = [], 0
    for i in sorted(range(n), key=lambda i: means[i], reverse=True):
        if len(chosen) >= keep_n and size >= want:
            break
        chosen.append(i)
        size += min(CHUNK, M - i * CHUNK)
    return [p for i in sorted(chosen) for p in range(i * CHUNK, min((i + 1) * CHUNK, M))]


def sparse_prefill(model, tokens: Sequence[int], kept: Sequence[int], step: int = STEP) -> list:
    """A new cache of `model` holding only `tokens[p]` for the sorted positions `kept`, each
    read at position p (each attends to the kept tokens before it), `step` at a time."""
    cache = new_cache(model)
    for s in range(0, len(kept), step):
        pos = list(kept[s : s + step])
        rows = mx.array(pos)
        with _ropes(model, lambda i, rope, rows=rows: _RowPositions(rope, rows, None)):
            model.model(mx.array([tokens[p] for p in pos])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


class _Shifted(nn.Module):
    """The layer's RoPE at `shift` positions past the cache's offset."""

    def __init__(self, rope, shift: int):
        super().__init__()
        self._rope, self._shift = rope, shift

    def __call__(self, x, offset=0):
        return self._rope(x, offset=offset + self._shift)


def positions_shifted(model, shift: int):
    """While inside, `model` reads the token after its cache's N entries at position N + shift
    (shift = M - N after a sparse read of N of M tokens)."""
    return _ropes(model, lambda i, rope: _Shifted(rope, shift))


@contextmanager
def _ropes(model, make):
    """While inside, layer i's RoPE module is `make(i, its own)`."""
    with ExitStack() as swaps:
        for i, layer in enumerate(model.layers):
            swaps.enter_context(_rope_swapped(layer, make(i, layer.self_attn.rope)))
        yield


def speculative_prefill(pair, tokens: Sequence[int], keep: float) -> tuple[list, list[int]]:
    """The peer's read of a prompt: `pair.source` scores every token of it, `select_chunks`
    picks `keep` of them, and `pair.target` reads the kept ones before the last token (the
    caller's decode reads the last itself, at M - 1, under `positions_shifted(target, M - 1 -
    N)`). Returns the target's cache (N entries) and the kept indices."""
    kept = select_chunks(score_tokens(pair.source, tokens), keep)
    return sparse_prefill(pair.target, tokens, [p for p in kept if p < len(tokens) - 1]), kept
