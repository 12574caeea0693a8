"""Teacher-forced scoring under a cache: log-probs of a continuation given a prefix's K/V.

For an example (prefix p, continuation c), the target reads the last prefix token and c[:-1]
on top of a cache holding p[:-1]; row i of the result is its log-distribution for c[i].
The teacher is the target on its own (native) cache; a student is the target on a cache some
method built from the source's K/V. Calibration trains against KL(teacher || student);
evaluation scores with the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import SpanKV, trace

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class Prepared:
    """One example ready for scoring: the source's span and the teacher's log-probs."""

    span: SpanKV
    inputs: mx.array  # last prefix token + continuation[:-1]
    teacher_logp: mx.array  # (T, V) log-probs of the target with its own cache
    # reader-mode examples: prefix ranges [start, end) the target reads itself (its earlier
    # replies) between translated spans, and the prefix tokens; () = the whole prefix translated
    replies: tuple[tuple[int, int], ...] = ()
    prefix: tuple[int, ...] = ()
    # per continuation token loss weights (mean 1), or None for a plain mean (`prefix_gain`)
    weights: mx.array | None = None
    # the target's own RoPE-free K/V of the same prefix tokens (for `kv_error`), or None
    native: SpanKV | None = None


def native_logp(model, ex) -> mx.array:
    """(T, V) log-probs of `model` (a LoadedModel) for the continuation, reading everything itself."""
    prefix, cont = list(ex.prefix), list(ex.continuation)
    logits = model.model(mx.array(prefix + cont[:-1])[None])[0, len(prefix) - 1 :]
    return nn.log_softmax(logits.astype(mx.float32), axis=-1)


def teacher_inputs(ex) -> mx.array:
    """What the target reads itself on top of the translated prefix: p[-1] + c[:-1]."""
    return mx.array([ex.prefix[-1]] + list(ex.continuation[:-1]))


def prepare(
    pair,
    ex,
    key_cut: str,
    reader_mode: bool = False,
    gain_weights: bool = False,
    native_kv: bool = False,
) -> Prepared:
    """The source's K/V of prefix[:-1] at `key_cut` and the teacher's log-probs.

    `reader_mode`: the student cache is built as in a conversation the small model reads for
    the target: the example's earlier replies (`ex.replies`) are read by the target itself on
    top of the translated spans before them; everything else is translated.
    `gain_weights`: weight the loss by `prefix_gain` (tokens the prefix determines count more).
    `native_kv`: also keep the target's own K/V of the prefix (for `kv_error`).
    """
    span = trace(pair.source, list(ex.prefix)[:-1], key_cut)
    teacher = native_logp(pair.target, ex)
    weights = prefix_gain(pair.target, ex) if gain_weights else None
    native = trace(pair.target, list(ex.prefix)[:-1], key_cut) if native_kv else None
    mx.eval(span.keys, span.values, teacher, weights, native and (native.keys, native.values))
    replies = tuple(ex.replies) if reader_mode and ex.replies else ()
    return Prepared(span, teacher_inputs(ex), teacher, replies,
                    tuple(ex.prefix) if replies else (), weights, native)  # fmt: skip


def student_logp(method, pair, prep: Prepared) -> mx.array:
    """(T, V) log-probs of the target on a cache that `method` translated from `prep.span`."""
    cache = new_cache(pair.target)  # fresh each call: gradients flow through its contents
    pos, span = prep.span.start, prep.span
    for start, end in (*prep.replies, (span.end, span.end)):
        if start > pos:  # translated up to the next reply (the whole span as it is, if none)
            piece = span if (pos, start) == (span.start, span.end) else span.sub(pos, start)
            keys, values = method.translate(piece, pair.target)
            for c, k, v in zip(cache, keys, values, strict=True):
                c.update_and_fetch(k, v)
        if end > start:  # the reply: the target reads its own words on top
            pair.target.model(mx.array(prep.prefix[start:end])[None], cache=cache)
        pos = max(pos, end)
    logits = pair.target.model(prep.inputs[None], cache=cache)[0]
    return nn.log_softmax(logits.astype(mx.float32), axis=-1)


def kl(teacher_logp: mx.array, student: mx.array, weights: mx.array | None = None) -> mx.array:
    """Mean over positions of KL(teacher || student), weighted by `weights` when given."""
    per_token = (mx.exp(teacher_logp) * (teacher_logp - student)).sum(-1)
    return per_token.mean() if weights is None else (per_token * weights).sum() / weights.sum()


def kv_error(method, prep: Prepared) -> mx.array:
    """mean |translated - native| / mean |native|, keys plus values, RoPE-free, every layer:
    KV Prediction's L1 cache term (apple/corenet), scale-free (0 exact, 2 for zeros)."""
    if prep.native is None:
        raise ValueError("kv_error needs examples prepared with native_kv=True")
    pairs = zip(method(prep.span), (prep.native.keys, prep.native.values), strict=True)
    return sum(mx.abs(mapped - native).mean() / mx.abs(native).mean() for mapped, native in pairs)


def prefix_gain(model, ex, context: int = 4, floor: float = 0.1) -> mx.array:
    """Loss weights for the continuation: how much the prefix tells the target about each token.

    gain_t = max(0, NLL_t with only the last `context` prefix tokens - NLL_t with the whole
    prefix), both under the native target; weights = (floor + gain) / mean(floor + gain). A
    token any context predicts (gain 0) keeps `floor`; one only the prefix predicts dominates.
    """
    cont = list(ex.continuation)
    short = type(ex)(tuple(ex.prefix[-context:]), ex.continuation, ex.source)
    targets = mx.array(cont)[:, None]
    nll_full = -mx.take_along_axis(native_logp(model, ex), targets, axis=-1)[:, 0]
    nll_short = -mx.take_along_axis(native_logp(model, short), targets, axis=-1)[:, 0]
    w = floor + mx.maximum(nll_short - nll_full, 0.0)
    return w / w.mean()


def heldout_scores(method, pair, prepared: Sequence[Prepared]) -> tuple[float, float]:
    """(mean KL(native || method), mean top-1 agreement with the native target), per example."""
    kls, agree = [], []
    for p in prepared:
        logp = student_logp(method, pair, p)
        kls.append(kl(p.teacher_logp, logp).item())
        same = logp.argmax(-1) == p.teacher_logp.argmax(-1)
        agree.append(same.astype(mx.float32).mean().item())
    if not kls:
        return float("nan"), float("nan")
    return float(np.mean(kls)), float(np.mean(agree))
