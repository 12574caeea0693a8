"""Decode a turn: mlx-lm's `stream_generate` on the answering model's own cache, each token into
the turn's records; and the room a turn has before it starts.

Invariant: a turn over n conversation tokens may add at most `max_kv_size - n` (no limit
without it), and a conversation past either model's context is refused before any work. Each
token is in `emitted` and the `TurnStats` before it is yielded, so whoever stops the stream
commits exactly what was yielded; the stream is closed however the loop stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from mlx_kvlingo.conversation.catchup import ModelCache
from mlx_kvlingo.conversation.records import (
    LABEL,
    ContextOverflowError,
    GenerationResponse,
    TurnStats,
)
from mlx_kvlingo.models.pair import ModelPair

import mlx.core as mx
from mlx_lm import stream_generate


def room(pair: ModelPair, n: int, name: str, max_kv_size: int | None) -> int | None:
    """Tokens a turn over `n` conversation tokens may add, answered by `name` (None: no limit);
    a conversation past either model's context or `max_kv_size` is a `ContextOverflowError`."""
    for label, m in (("small", pair.source), ("large", pair.target)):
        if m.context_length is not None and n > m.context_length:
            raise ContextOverflowError(
                f"the conversation is {n} tokens; the {label} model ({m.name}) handles at "
                f"most {m.context_length}: shorten the message, drop the oldest turns with "
                f"/trim (Session.trim) or start over with /reset"
            )
    if max_kv_size is None:
        return None
    left = max_kv_size - n
    if left < 1:
        raise ContextOverflowError(
            f"the conversation is {n} tokens, the {name} model's context "
            f"limit is {max_kv_size} (max_kv_size): drop the oldest turns with "
            f"/trim (Session.trim) or start over with /reset"
        )
    return left


def decode(m: ModelCache, transcript, prompt: list[int], stats: TurnStats, emitted: list[int], *,
           limit: int, capped: bool, kwargs: dict, t0: float, cancel: threading.Event,
           first: Callable[[], None], between: Callable[[float | None], float] | None = None
           ) -> Iterator[GenerationResponse]:  # fmt: skip
    """mlx-lm decodes `prompt` on `m`'s cache, at most `limit` tokens (`capped`: the limit is
    the context's, so "length" ends as "context"). Each token goes to `emitted` and
    `stats` (TTFT from `t0`), then is yielded; the last carries `stats`. `first()` runs after the
    first token; `between(decode_s)`, after each token but the last, returns the seconds it took
    (the small model's decode time of a token excludes them: translating ahead)."""
    procs = kwargs.get("logits_processors")
    if procs:  # they see the earlier answers and this one, not only this turn's
        kwargs = {**kwargs, "logits_processors": over_answers(procs, transcript.answers())}
    stream = stream_generate(m.loaded.model, transcript.tokenizer, mx.array(prompt),
                             max_tokens=limit, prompt_cache=m.cache, **kwargs)  # fmt: skip

    def out(r, finish_reason=None, handoff=None) -> GenerationResponse:
        return GenerationResponse(r.text, r.token, r.logprobs, r.from_draft, r.prompt_tokens,
                                  r.prompt_tps, r.generation_tokens, r.generation_tps,
                                  r.peak_memory, finish_reason, LABEL[m.name], handoff)  # fmt: skip

    try:
        last_token_at, between_s = None, 0.0
        for r in stream:
            now = time.perf_counter()
            # this token's decode time: the wall time since the last one, less `between`'s
            decode_s = None if last_token_at is None else now - last_token_at - between_s
            last_token_at = now
            if stats.ttft_s is None:
                stats.ttft_s = now - t0
            emitted.append(r.token)
            stats.text += r.text
            stats.logprobs.append(r.logprobs[r.token].item())
            stats.generation_tokens, stats.generation_tps = r.generation_tokens, r.generation_tps
            stats.prompt_tps, stats.peak_memory_gb = r.prompt_tps, r.peak_memory
            stats.prompt_s = len(prompt) / r.prompt_tps if r.prompt_tps else 0.0
            if len(emitted) == 1:
                first()
            end = r.finish_reason
            if end is None and cancel.is_set():
                end = "cancelled"
            if end is not None:
                stats.finish_reason = "context" if capped and end == "length" else end
                yield out(r, stats.finish_reason, handoff=stats)
                break
            yield out(r)
            if between is not None:
                between_s = between(decode_s)
    finally:
        stream.close()


def over_answers(processors: list, answers: list[int]) -> list:
    """Logits processors that see the conversation's answers, earlier ones first, then this one,
    never the prompt part mlx-lm passes them (whatever read the turn, the user's text is not
    penalized, and an answer cannot copy the last one)."""
    past = mx.array(answers, dtype=mx.int32)

    def wrap(proc):
        skip = []  # the prompt part: all that the first call gets

        def call(tokens, logits):
            if not skip:
                skip.append(tokens.size)
            return proc(mx.concatenate([past, tokens[skip[0] :]]), logits)

        return call

    return [wrap(p) for p in processors]
