"""One answer as mlx-lm-shaped responses, under the pair's one lock: the public
`stream_generate` and `Conversation.send` both run `open_stream`.

Invariant: the pair is held (`lock.py`) from the stream's first `next()` until it ends, is closed
or is collected; the session's turn (session.py: hand-off, decode, commit) runs inside, so
however the stream stops its tokens are the answer and both caches stay consistent. An answer's
last response (`finish_reason` set) comes once the turn is committed and its record complete.
`pair` is the public `Pair`: `.models`, `.names`, `.lock`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from mlx_kvlingo.conversation import sampling
from mlx_kvlingo.conversation.lock import Ticket
from mlx_kvlingo.conversation.records import (
    AUTO_THRESHOLD,
    LABEL,
    ROLE,
    GenerationResponse,
    SessionError,
    TurnStats,
    status_line,
)
from mlx_kvlingo.conversation.session import Session

OPTIONS = {"model": "large", "reader": None, "max_tokens": 256, "sampler": None,
            "logits_processors": None, "prompt_progress_callback": None,
            "auto_threshold": AUTO_THRESHOLD, "wait": True, "timeout": None, "redo": False}  # fmt: skip


def sampler_kwargs(pair: Any, model: str, kw: dict, seed: bool = True) -> dict:
    """mlx-lm's sampler keywords for `model`'s answer: `sampler`/`logits_processors` as given,
    else built from the sampling settings in `kw` over the model's defaults (sampling.resolve);
    with `seed`, also the seed setting."""
    loaded = pair.models.source if ROLE[model] == "source" else pair.models.target
    try:
        cfg = sampling.resolve(loaded, {k: v for k, v in kw.items() if k not in OPTIONS})
    except ValueError as e:
        raise SessionError(str(e)) from None
    out = {"sampler": kw.get("sampler") or cfg.sampler(),
           "logits_processors": kw.get("logits_processors") or cfg.logits_processors()}  # fmt: skip
    return {**out, "seed": cfg.seed} if seed else out


def open_stream(pair: Any, cache: Session, prompt: Any, cancel: threading.Event,
          kw: dict) -> Iterator[GenerationResponse]:  # fmt: skip
    """Checks now (model, sampling, prompt), the work from the first `next()` on."""
    opts = {k: kw.get(k, v) for k, v in OPTIONS.items()}
    model = opts["model"]
    if model not in (*ROLE, "auto") and not (model is None and opts["redo"]):
        raise SessionError(f"unknown model {model!r}; use 'small', 'large' or 'auto'")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise TypeError(f"prompt must be a str, a list of token ids or None, not {type(prompt)}")
    for m in ("small", "large") if model in ("auto", None) else (model,):
        sampler_kwargs(pair, m, kw)  # a bad setting fails now
    ticket = Ticket(cache, cancel)
    stream = _run(pair, cache, prompt, ticket, opts, kw)
    ticket.stream = weakref.ref(stream)
    return stream


def _run(pair: Any, cache: Session, prompt: Any, ticket: Ticket, opts: dict,
         kw: dict) -> Iterator[GenerationResponse]:  # fmt: skip
    model = opts["model"]
    if not pair.lock.acquire(ticket, opts["wait"], opts["timeout"]):
        yield final(pair, None, LABEL[ROLE.get(model, "target")])
        return
    policy, reader = cache.policy, opts["reader"]
    try:
        if reader is not None:  # this answer only (a policy set anew resets its budgets)
            cache.policy = replace(policy, reader=reader)
        if isinstance(prompt, str):
            cache.add_user(prompt)
        elif prompt is not None:
            cache.add_tokens(prompt)
        if model != "auto":
            yield from _answer(pair, cache, model, ticket.cancel, opts, kw)
            return
        small = None
        for small in _answer(pair, cache, "small", ticket.cancel, opts, kw):
            if small.finish_reason is None:
                yield small
        st = small.handoff if small is not None else None
        if st is not None and st.confidence is not None and st.finish_reason != "cancelled":
            st.escalating = st.confidence < opts["auto_threshold"]
        if small is not None:
            yield small
        if st is not None and st.escalating:
            yield from _answer(pair, cache, "large", ticket.cancel, {**opts, "redo": True}, kw)
    finally:
        if reader is not None:
            cache.policy = policy
        pair.lock.release()


def _answer(pair: Any, cache: Session, model: str | None, cancel: threading.Event,
            opts: dict, kw: dict) -> Iterator[GenerationResponse]:  # fmt: skip
    """One answer: the session's turn (hand-off, decode, commit), one response per token; the
    last one (`finish_reason` set) comes once the turn is committed and its record complete."""
    label = model
    if opts["redo"] and model is None:  # escalate: the other model than the last answer's
        last = cache.last_turn
        label = "small" if last is not None and last.model == "target" else "large"
    sample = sampler_kwargs(pair, str(label), kw)
    seed(sample.pop("seed"), cache.messages)
    cb = opts["prompt_progress_callback"]
    go = cache.escalate if opts["redo"] else cache.generate
    events = go(ROLE[model] if model else None, max_tokens=opts["max_tokens"], **sample,
                progress=(lambda _who, done, total: cb(done, total)) if cb else None)  # fmt: skip
    if cancel.is_set():  # cancel() landed before the turn cleared the session's flag
        cache.cancel()
    before, last = cache.last_turn, None
    try:
        for last in events:
            if last.handoff is None:
                yield last
    finally:
        events.close()  # commits what was emitted, trims the caches to match
    st = cache.last_turn
    if st is not None and st is not before:
        yield final(pair, st, LABEL[st.model], last)


def final(pair: Any, st: TurnStats | None, model: str,
          last: GenerationResponse | None = None) -> GenerationResponse:  # fmt: skip
    """An answer's last response: its last token (`last`; none when it ended before one) with
    the finish reason, the hand-off record and the status line."""
    if st is None:
        return GenerationResponse("", None, None, False, 0, 0.0, 0, 0.0, 0.0, "cancelled", model,
                                  status="cancelled")  # fmt: skip
    reason = "cancelled" if st.finish_reason == "interrupted" else st.finish_reason
    names = {ROLE[k]: v for k, v in pair.names.items()}
    out = last or GenerationResponse("", None, None, False, st.prompt_tokens, st.prompt_tps,
                                     st.generation_tokens, st.generation_tps,
                                     st.peak_memory_gb)  # fmt: skip
    return replace(
        out, finish_reason=reason, model=LABEL[st.model], handoff=st, status=status_line(st, names)
    )


def seed(value: int | None, messages: list[dict[str, str]]) -> None:
    """The one seed rule: MLX is seeded with `value` plus the number of assistant messages
    before the user message answered: reproducible from the messages alone (a resent or
    restored conversation), the same for whichever model answers or re-answers, a new draw
    each turn."""
    if value is not None:
        import mlx.core as mx

        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        before = messages[: users[-1]] if users else messages
        mx.random.seed(value + sum(1 for m in before if m["role"] == "assistant"))
