"""What a user gets: one answer at a time per model pair, streamed as mlx-lm-shaped responses
(`GenerationResponse`, the last carrying the turn's record `TurnStats` and its status line), as
`stream_generate` and `Conversation.send` run them (`open_stream`).

Invariant: at most one holder drives a pair's models (`PairLock`: a stream from its first
`next()` until it ends, is closed or is collected; a change to a conversation; a server's
request); MLX evaluation is never interleaved from two threads. The thread that holds it asking
again: under a plain hold, granted (nested); for another conversation or while its stream runs,
BusyError; for the same conversation, its stream left unfinished, that stream is closed (it
commits what it emitted), then granted. Another thread waits (up to `timeout`, then BusyError;
`wait=False`: BusyError at once), or gives up once its `cancel` event is set.
"""

from __future__ import annotations

import json
import math
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from mlx_kvlingo.config import AUTO_THRESHOLD

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationResponse as MlxResponse
from mlx_lm.sample_utils import make_logits_processors, make_sampler

#: the two roles by size or by direction
ROLE = {"small": "source", "large": "target", "source": "source", "target": "target"}
LABEL: dict[str, Literal["small", "large"]] = {"source": "small", "target": "large"}


class SessionError(ValueError):
    """A request the session cannot honour (nothing to answer, unknown model, ...)."""


class ContextOverflowError(SessionError):
    """The conversation does not fit a model's context (`max_kv_size`)."""


class SessionFileError(SessionError):
    """A session file that is unreadable or was written for another model pair."""


def role(model: str) -> str:
    if model not in ROLE:
        raise SessionError(f"unknown model {model!r}; use 'source'/'small' or 'target'/'large'")
    return ROLE[model]


@dataclass
class Switch:
    """How a model caught up on the span [start, end) that the other model held and it lacked."""

    into: str
    mode: str
    start: int
    end: int
    translated: int = 0  # tokens translated at this switch
    retranslated: int = 0  # of those, tokens this model already held (naive mode)
    seconds: float = 0.0
    note: str = ""  # e.g. why it re-prefilled instead of translating
    #: then the large model read the last `tail_read` tokens and recomputed `recomputed`
    recomputed: int = 0
    tail_read: int = 0
    recompute_s: float = 0.0

    @property
    def lacked(self) -> int:
        return self.end - self.start


@dataclass
class Read:
    """The small model reading for the large one before a large answer (reader "small")."""

    model: str  # the reader: "source"
    tokens: int = 0  # tokens it read itself (prefill only, no decoding)
    seconds: float = 0.0
    catch_up: Switch | None = None  # how it first caught up on the large's last answer
    start: int = 0  # where its read began (the tokens its cache held then)


@dataclass
class TurnStats:
    """One answer: which model, what it cost, how it ended."""

    model: str
    mode: str
    switch: Switch | None = None
    prompt_tokens: int = 0  # tokens the answering model read itself this turn
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    ttft_s: float | None = None  # from the call to the first token, switch included
    peak_memory_gb: float = 0.0
    finish_reason: str | None = None  # stop | length | context | cancelled | interrupted
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    read: Read | None = None  # the small model's read for this answer (reader "small")
    prompt_s: float = 0.0  # the answering model's own prefill time this turn
    read_note: str = ""  # why the large read the new turn itself (readers "auto", "tokens")
    retention: float | None = None  # expected where it turned the faster small path down
    alternative_ttft_s: float | None = None  # the other way's TTFT, predicted (reader.py)
    predicted_ttft_s: float | None = None  # what was predicted for the path taken
    escalating: bool = False  # a cascade's small answer under the threshold

    @property
    def confidence(self) -> float | None:
        """Mean token log-probability of the answer, the score of model "auto"."""
        return float(np.mean(self.logprobs)) if self.logprobs else None


@dataclass
class GenerationResponse(MlxResponse):
    """mlx-lm's `GenerationResponse` (its fields, in its order; `token` and `logprobs` None:
    stopped before its first token), who answered and, on an answer's last response, its
    record (`handoff`) and `status` line."""

    model: str = "large"  # "small" or "large"
    handoff: TurnStats | None = None
    status: str = ""


OPTIONS = {"model": "large", "reader": None, "max_tokens": 256, "sampler": None,
            "logits_processors": None, "prompt_progress_callback": None,
            "auto_threshold": AUTO_THRESHOLD, "wait": True, "timeout": None, "redo": False}  # fmt: skip


class BusyError(RuntimeError):
    """The model pair is in use by another generation (one generation at a time)."""


@dataclass(eq=False)
class Ticket:
    """Who asks for the pair (a conversation, a request), its cancel event, its stream."""

    owner: Any
    cancel: threading.Event
    stream: weakref.ref[Generator] | None = None


class PairLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: int | None = None
        self._ticket: Ticket | None = None
        self._nested = 0  # grants nested in this thread's plain hold

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def acquire(self, owner: Any, cancel: threading.Event | None = None, wait: bool = True,
                timeout: float | None = None) -> bool:  # fmt: skip
        """Take the pair for `owner` (a stream's `Ticket`, else a plain hold): module docstring."""
        ticket = owner if isinstance(owner, Ticket) else Ticket(owner, cancel or threading.Event())
        me = threading.get_ident()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._thread is None:
                    self._thread, self._ticket = me, ticket
                    return True
                held = self._ticket
                if self._thread == me and held.stream is None:
                    self._nested += 1
                    return True
                if self._thread == me:
                    stale = held.stream()
                    if stale is None or stale.gi_running or held.owner is not ticket.owner:
                        raise BusyError(
                            "this thread is streaming another conversation of this pair: "
                            "finish that stream or close() it first (one generation at a time)"
                        )
                elif not wait:
                    raise BusyError(
                        "the model pair is busy with another generation; retry later, "
                        "or wait=True to wait for it"
                    )
                elif ticket.cancel.is_set():
                    return False
                else:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise BusyError(
                            f"the model pair stayed busy for {timeout} s (another generation)"
                        )
                    self._cond.wait(left)
                    continue
            stale.close()  # commits what it emitted and releases the pair

    def release(self) -> None:
        with self._cond:
            if self._nested:
                self._nested -= 1
                return
            self._thread, self._ticket = None, None
            self._cond.notify_all()

    def wake(self) -> None:
        """Let waiters look at their cancel events again."""
        with self._cond:
            self._cond.notify_all()


@dataclass(frozen=True)
class Sampling:
    temp: float = 0.7
    top_p: float = 0.9
    top_k: int = 0  # 0: off
    min_p: float = 0.05
    repetition_penalty: float = 1.1  # 1.0: off
    repetition_context_size: int = 256  # the last answer and the new turn, not only this one
    seed: int | None = None  # seeds MLX before the answer (None: leave it; `seed`)

    def sampler(self):
        """mlx-lm's sampler for these settings (argmax when temp is 0)."""
        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> list:
        """mlx-lm's repetition penalty over the last `repetition_context_size` tokens, if on."""
        if self.repetition_penalty in (None, 1.0):
            return []
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
        )


DEFAULTS = Sampling()
FIELDS = tuple(f.name for f in fields(Sampling))


def generation_config(folder: str | Path | None) -> dict:
    try:
        raw = json.loads((Path(folder) / "generation_config.json").read_text())
        out = {"temp": 0.0} if raw.get("do_sample") is False else {}
    except (TypeError, OSError, ValueError, AttributeError):  # no folder, file, JSON object
        return {}
    kinds = dict(temperature=float, top_p=float, top_k=int, min_p=float, repetition_penalty=float)
    for k, kind in kinds.items():
        if type(raw.get(k)) in (int, float) and not (k == "temperature" and out):
            out["temp" if k == "temperature" else k] = kind(raw[k])
    return out


def resolve(model=None, sampling: Mapping[str, Any] | None = None) -> Sampling:
    """The settings for `model` (a LoadedModel or None): `sampling`'s set fields over its
    generation_config.json over `DEFAULTS`; ValueError on an unknown field."""
    sampling = sampling or {}
    unknown = set(sampling) - set(FIELDS)
    if unknown:
        hint = " (temperature is 'temp')" if "temperature" in unknown else ""
        raise ValueError(
            f"unknown sampling settings {sorted(map(str, unknown))}{hint}; known: "
            f"{', '.join(FIELDS)}"
        )
    explicit = {k: v for k, v in sampling.items() if v is not None}
    base = replace(DEFAULTS, **generation_config(getattr(model, "folder", None)))
    if explicit.get("temp") == 0 or (base.temp == 0 and "temp" not in explicit):
        base = replace(base, repetition_penalty=1.0)  # greedy stays plain unless asked
    return replace(base, **explicit)


def sampler_kwargs(pair: Any, model: str, kw: dict, seed: bool = True) -> dict:
    """mlx-lm's `sampler`/`logits_processors` for `model`'s answer: as given, else from the
    sampling settings in `kw`; with `seed`, the seed."""
    loaded = pair.models.source if ROLE[model] == "source" else pair.models.target
    try:
        cfg = resolve(loaded, {k: v for k, v in kw.items() if k not in OPTIONS})
    except ValueError as e:
        raise SessionError(str(e)) from None
    out = {"sampler": kw.get("sampler") or cfg.sampler(),
           "logits_processors": kw.get("logits_processors") or cfg.logits_processors()}  # fmt: skip
    return {**out, "seed": cfg.seed} if seed else out


def seed(value: int | None, messages: list[dict[str, str]]) -> None:
    """MLX is seeded with `value` plus the number of assistant messages before the user message
    answered: the same from the messages alone, for whichever model, a new draw each turn."""
    if value is not None:
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        mx.random.seed(value + sum(m["role"] == "assistant" for m in messages[:last]))


def over_answers(processors: list, answers: list[int]) -> list:
    """Logits processors that see the conversation's answers, earlier ones first, then this one,
    never the prompt mlx-lm passes them (the user's text is not penalized)."""
    past = mx.array(answers, dtype=mx.int32)

    def wrap(proc):
        skip = []  # the prompt part: all that the first call gets

        def call(tokens, logits):
            if not skip:
                skip.append(tokens.size)
            return proc(mx.concatenate([past, tokens[skip[0] :]]), logits)

        return call

    return [wrap(p) for p in processors]


def open_stream(pair: Any, cache: Any, prompt: Any, cancel: threading.Event,
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


def _run(pair: Any, cache: Any, prompt: Any, ticket: Ticket, opts: dict,
         kw: dict) -> Iterator[GenerationResponse]:  # fmt: skip
    model = opts["model"]
    if not pair.lock.acquire(ticket, wait=opts["wait"], timeout=opts["timeout"]):
        label = LABEL[ROLE.get(model, "target")]  # cancelled while it waited
        yield GenerationResponse(
            "", None, None, False, 0, 0.0, 0, 0.0, 0.0, "cancelled", label, status="cancelled"
        )
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
        st = None
        for small in _answer(pair, cache, "small", ticket.cancel, opts, kw):
            st = small.handoff  # on the answer's last response
            if st is not None and st.confidence is not None and st.finish_reason != "cancelled":
                st.escalating = st.confidence < opts["auto_threshold"]
            yield small
        if st is not None and st.escalating:
            yield from _answer(pair, cache, "large", ticket.cancel, {**opts, "redo": True}, kw)
    finally:
        if reader is not None:
            cache.policy = policy
        pair.lock.release()


def _answer(pair: Any, cache: Any, model: str | None, cancel: threading.Event,
            opts: dict, kw: dict) -> Iterator[GenerationResponse]:  # fmt: skip
    """One answer, one response per token; the last once the turn is committed."""
    label = model
    if opts["redo"] and model is None:  # escalate: the other model than the last answer's
        label = "small" if getattr(cache.last_turn, "model", None) == "target" else "large"
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
        yield final(pair, st, last)


def final(pair: Any, st: TurnStats, last: GenerationResponse | None = None) -> GenerationResponse:
    """An answer's last response: its last token (`last`, if any), the record, the status."""
    reason = "cancelled" if st.finish_reason == "interrupted" else st.finish_reason
    names = {ROLE[k]: v for k, v in pair.names.items()}
    out = last or GenerationResponse("", None, None, False, st.prompt_tokens, st.prompt_tps,
                                     st.generation_tokens, st.generation_tps,
                                     st.peak_memory_gb)  # fmt: skip
    return replace(
        out, finish_reason=reason, model=LABEL[st.model], handoff=st, status=status_line(st, names)
    )


def share(x: float) -> str:
    """A retention with two decimals, rounded down: one under a threshold never reads as it."""
    return f"{math.floor(x * 100 + 1e-9) / 100:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def status_line(st: TurnStats, names: dict) -> str:
    """Who read what and what it cost, the TTFT (and the other way's, predicted), then mlx-lm's
    `N tokens · X tok/s · peak Z GB`."""
    me = LABEL[st.model]
    parts = [f"{me} ({names[st.model]})"]
    rd, sw = st.read, st.switch
    if rd is not None:
        other, c = LABEL[rd.model], rd.catch_up
        if c is not None:
            how = f"got the last answer translated ({c.translated} tok {_ms(c.seconds)})"
            if not c.translated:
                how = f"re-read the last answer ({c.lacked} tok, {c.note or 're-prefill'})"
            parts.append(f"{other} {how}")
        parts.append(f"{other} read {rd.tokens} tok {_ms(rd.seconds)}")
    if sw is not None:
        if sw.translated:
            again = f" ({sw.retranslated} again)" if sw.retranslated else ""
            parts.append(f"translated {sw.translated} tok{again} {sw.seconds * 1e3:.1f} ms")
            if sw.tail_read:
                parts.append(f"{me} read the last {sw.tail_read} tok and recomputed "
                             f"{sw.recomputed} translated tok {_ms(sw.recompute_s)}")  # fmt: skip
        else:
            parts.append(f"switch {sw.lacked} tok {sw.note or 're-prefill'}")
    read = f"{me} read {st.prompt_tokens} tok"  # as mlx-lm measures it, up to its first token
    read += f" {_ms(st.prompt_s)}" if st.prompt_tokens and st.prompt_s else ""
    read += f" {st.prompt_tps:.1f} tok/s" if st.prompt_tokens > 1 else ""
    parts.append(read + (f" ({st.read_note})" if st.read_note else ""))
    if st.ttft_s is not None:
        ttft = f"TTFT {_ms(st.ttft_s)}"
        alt = st.alternative_ttft_s
        if alt is not None and st.model == "target":
            other = f"{me} alone" if rd is not None else f"{LABEL['source']} + translation"
            why = ""
            if rd is None and st.retention is not None and alt < st.ttft_s:
                why = f", {_ms(st.ttft_s - alt)} sooner, keeping ≈{share(st.retention)}"
            ttft += f" ({other}: TTFT ≈ {_ms(alt)}{why})"
        parts.append(ttft)
    parts.append(f"{st.generation_tokens} tokens {st.generation_tps:.1f} tok/s")
    parts.append(f"peak {st.peak_memory_gb:.2f} GB")
    if st.finish_reason in ("cancelled", "interrupted"):
        parts.append("stopped")
    elif st.finish_reason == "context":
        parts.append("context full (/trim or /reset)")
    return " · ".join(parts)
