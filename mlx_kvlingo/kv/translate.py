"""Translating into a cache: a span of the small model's K/V, mapped and re-rotated, appended
to the large model's mlx-lm cache at its true positions [start, end).

The hand-off that uses it (the small model reads, the span the large one lacks is translated,
the large reads the turn's last tokens and recomputes) is the conversation's own
(`Session.hand_off`): there is one, and everything that measures it drives it.
"""

from __future__ import annotations

from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import SpanKV
from mlx_kvlingo.kv.translator import Translator

import mlx.core as mx


def append_translation(model, translator: Translator, span: SpanKV, cache: list) -> None:
    """Translate `span` for `model` and append it to `model`'s `cache`, which must end where
    the span starts. A translator that keeps the model's own first token (`native_first`)
    writes it over the translated position 0 in place, before the cache writes."""
    if cache[0].offset != span.start:
        raise ValueError(
            f"{model.name} cache holds {cache[0].offset} tokens but the span starts at {span.start}"
        )
    append_kv(cache, *translator.translate(span, model))


#: a measuring warm-up (a pair's first start on a machine; conversation/warmup.py) translates a
#: scratch span this long once (CPU only): later translations up to this length then reuse
#: memory already mapped instead of faulting fresh pages in
RESERVE_TOKENS = 1024


def reserve_translation_memory(
    model, translator: Translator, n_tokens: int = RESERVE_TOKENS
) -> bool:
    """On the CPU backend, translate a random span of `n_tokens` into a scratch cache of
    `model` and free both to the allocator, so that the first translation of each new length
    up to `n_tokens` costs what a repeat costs. With glibc keeping freed memory mapped
    (`_cpu_memory.tune`), one long translation's pages serve every shorter one; without this
    the first translation at each longer length faulted ~100 MB in (dense demo pair, 1024
    tokens: 24,000 minor faults, ~1.5x a repeat; eval/RESULTS.md). Returns whether it ran.
    Off the CPU it does nothing: Metal keeps its own buffers."""
    if mx.default_device() != mx.cpu or n_tokens < 1:
        return False
    side = translator.config.source
    keys = mx.random.normal((side.layers, 1, side.kv_heads, n_tokens, side.head_dim))
    values = mx.random.normal((side.layers, 1, side.kv_heads, n_tokens, side.value_dim))
    cache = new_cache(model)
    append_kv(cache, *translator.translate(SpanKV(keys, values, start=0), model))
    mx.eval([(c.keys, c.values) for c in cache])
    del cache, keys, values
    # MLX's own cache keeps buffers for requests of nearly their size only; handed to malloc,
    # their pages serve requests of any size
    mx.clear_cache()
    return True
