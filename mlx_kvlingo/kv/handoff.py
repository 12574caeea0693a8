"""The hand-off: source prefill, translate, fill the target's cache (the target then decodes).

The target always processes at least the last prompt token itself, so the translated cache
covers tokens [0, n-1) and `stream_generate` starts from token n-1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import SpanKV, capture_from_cache, needs_recording, prefill
from mlx_kvlingo.kv.translator import Translator

import mlx.core as mx

if TYPE_CHECKING:  # types only: the method does not depend on how models load
    from mlx_kvlingo.models.pair import ModelPair


def translate_into(pair: ModelPair, translator: Translator, span: SpanKV, cache: list) -> None:
    """Translate `span` and append it to the target's `cache`, which must end where it starts."""
    append_translation(pair.target, translator, span, cache)


def append_translation(model, translator: Translator, span: SpanKV, cache: list) -> None:
    """Translate `span` for `model` and append it to `model`'s `cache`, which must end where
    the span starts. A translator that keeps the model's own first token (`native_first`)
    writes it over the translated position 0 in place, before the cache writes."""
    if cache[0].offset != span.start:
        raise ValueError(
            f"{model.name} cache holds {cache[0].offset} tokens but the span starts at {span.start}"
        )
    append_kv(cache, *translator.translate(span, model))


#: the warm-up translates a scratch span this long once (CPU only): later translations up to
#: this length then reuse memory already mapped instead of faulting fresh pages in
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


class PromptTooLongError(ValueError):
    pass


def check_context(pair: ModelPair, n_tokens: int) -> None:
    """Refuse a prompt longer than either model's context, before any work is done."""
    for role, m in (("source", pair.source), ("target", pair.target)):
        limit = m.context_length
        if limit is not None and n_tokens > limit:
            raise PromptTooLongError(
                f"the prompt has {n_tokens} tokens; the {role} ({m.name}) handles at most {limit}: "
                "shorten it or drop early turns"
            )


@dataclass
class Handoff:
    """What a switch produced: both caches and what it cost."""

    source_cache: list
    target_cache: list
    source_prefill_s: float
    translate_s: float
    translated_tokens: int


def handoff(
    pair: ModelPair,
    translator: Translator,
    tokens: list[int],
    *,
    kv_bits: int | None = None,
    source_cache: list | None = None,
) -> Handoff:
    """Source reads `tokens[:-1]`; the target gets them translated, ready to decode from.

    With `source_cache` already holding a prefix, only the rest is prefilled.
    """
    if len(tokens) < 2:
        raise ValueError("need at least 2 prompt tokens: the target must process the last itself")
    check_context(pair, len(tokens))
    src_cache = source_cache if source_cache is not None else new_cache(pair.source)
    have, end = src_cache[0].offset, len(tokens) - 1
    if have > end:
        raise ValueError(f"source cache holds {have} tokens, more than the {end} to hand off")
    t0 = time.perf_counter()
    if have and needs_recording(pair.source, translator.config.key_cut):
        raise ValueError("a pre_norm translator needs the source to prefill the whole span itself")
    if have < end:
        span = prefill(pair.source, tokens[have:end], src_cache, cut=translator.config.key_cut)
        if have:
            old = capture_from_cache(pair.source, src_cache, 0, have)
            span = SpanKV(
                mx.concatenate([old.keys, span.keys], axis=3),
                mx.concatenate([old.values, span.values], axis=3),
                0,
            )
    else:
        span = capture_from_cache(pair.source, src_cache, 0, end)
    span.tokens = tuple(tokens[:end])
    t1 = time.perf_counter()
    tgt_cache = new_cache(pair.target, kv_bits=kv_bits)
    translate_into(pair, translator, span, tgt_cache)
    t2 = time.perf_counter()
    return Handoff(src_cache, tgt_cache, t1 - t0, t2 - t1, span.length)
