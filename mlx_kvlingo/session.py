"""Alternation: one conversation, two models, each with its own cache.

The conversation is one list of token ids. Each model's mlx-lm cache holds a prefix of it,
`held` tokens long. When a model is asked to answer, it first catches up on what it lacks:

    alternation  translate the span the other model holds and this one lacks (only that
                 span, appended at its true absolute positions), then read the rest itself;
    naive        rebuild this model's cache by translating everything the other model holds,
                 so spans that came from translation are translated again (the baseline that
                 drifts turn after turn);
    reprefill    read everything it lacks itself (the exact reference, and the slow one).

The answering model always reads at least the last conversation token itself and then
decodes with mlx-lm's `stream_generate` on its own cache. Messages are appended as the
chat template's tokens. Nothing here prints: `generate` yields `TokenEvent`s and every turn
leaves a `TurnStats` (with the `Switch` it needed, if any) in `Session.turns`.

Key cut: spans are read from the outgoing model's cache and un-rotated exactly (the
`post_norm` cut). A `pre_norm` translator on a k_norm family needs the keys before k_norm,
which caches do not keep: the outgoing model recomputes the span on top of its cached
prefix (one forward pass over the span) to record them. Naive mode refuses such a
translator, because recomputing would quietly undo the compounding it exists to show.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from .capture import SpanKV, capture_from_cache, needs_recording, prefill
from .decode import append_kv
from .pair import LoadedModel, ModelPair
from .translator import Side, Translator

MODES = ("alternation", "naive", "reprefill")
MODELS = ("source", "target")
ALIASES = {"source": "source", "target": "target", "small": "source", "large": "target"}
SESSION_SCHEMA = "mlx-kvlingo/session"
SESSION_SCHEMA_VERSION = 1


class SessionError(ValueError):
    """A request the session cannot honour (nothing to answer, unknown model, ...)."""


class ContextOverflowError(SessionError):
    """The conversation does not fit a model's context (`max_kv_size`)."""


class SessionFileError(SessionError):
    """A session file that is unreadable or was written for another model pair."""


class SessionBusyError(RuntimeError):
    """A generation is already running on this session."""


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

    @property
    def lacked(self) -> int:
        return self.end - self.start

    @property
    def translated_span(self) -> tuple[int, int] | None:
        return (self.end - self.translated, self.end) if self.translated else None


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

    @property
    def confidence(self) -> float | None:
        return answer_confidence(self.logprobs) if self.logprobs else None


@dataclass
class TokenEvent:
    """One streamed token. The turn's last event carries its `stats`."""

    text: str
    token: int | None
    logprob: float | None
    model: str
    stats: TurnStats | None = None


def answer_confidence(logprobs: Sequence[float]) -> float:
    """Mean token log-probability of an answer: 0 is certain, more negative is less sure.

    This is the `/auto` cascade's score: the small model answers, and the large one takes
    over when the score falls below a threshold.
    """
    if not logprobs:
        raise ValueError("an empty answer has no confidence")
    return float(np.mean(logprobs))


@dataclass
class _Model:
    name: str
    loaded: LoadedModel
    cache: list
    held: int = 0  # the cache holds conversation tokens [0, held)


def _new_cache(loaded: LoadedModel) -> list:
    return [KVCache() for _ in range(loaded.geometry.layers)]


def _prefix_copy(cache: list, n: int) -> list:
    """Exact-length copies of the first n positions of a cache (new arrays, same values)."""
    out = []
    for c in cache:
        k = KVCache()
        if n:
            k.keys = c.keys[..., :n, :]
            k.values = c.values[..., :n, :]
            k.offset = n
        out.append(k)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def model_fingerprint(loaded: LoadedModel) -> str:
    """Identify a model's weights across dtypes: signs of the clearly non-zero entries of its
    embedding and K/V projections (dtype casts and 4-bit rounding keep those signs)."""
    h = hashlib.sha256(json.dumps(loaded.geometry.as_dict(), sort_keys=True).encode())
    for name, w in sorted(tree_flatten(loaded.model.parameters())):
        if not any(s in name for s in ("embed_tokens", "k_proj", "v_proj")):
            continue
        if not mx.issubdtype(w.dtype, mx.floating):
            continue
        x = np.array(w.reshape(-1)[:256].astype(mx.float32))
        big = np.abs(x) > 0.5 * (x.std() + 1e-12)
        h.update(name.encode())
        h.update(np.packbits(big).tobytes() + np.packbits((x > 0) & big).tobytes())
    return h.hexdigest()[:16]


class Session:
    """One conversation over a model pair: the source (small) and target (large) model.

    `forward` translates source K/V into the target's cache, `backward` the other way.
    Without `backward`, handing the conversation back to the source re-prefills (and the
    switch says so in its `note`).

        s = Session(pair, forward, backward)
        s.add_user("Hello")
        for ev in s.generate("source"):
            print(ev.text, end="")
        s.add_user("Tell me more")
        for ev in s.generate("target"):   # translates only what the target lacks
            ...
    """

    def __init__(
        self,
        pair: ModelPair,
        forward: Translator | None,
        backward: Translator | None = None,
        mode: str = "alternation",
        *,
        system_prompt: str | None = None,
        max_kv_size: int | None = None,
    ):
        self.pair = pair
        self.forward = forward
        self.backward = backward
        src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
        for label, tr, a, b in (("forward", forward, src, tgt), ("backward", backward, tgt, src)):
            if tr is not None and (tr.config.source, tr.config.target) != (a, b):
                raise SessionError(
                    f"the {label} translator maps {tr.config.source} -> {tr.config.target}, "
                    f"but this direction needs {a} -> {b}"
                )
        self.mode = mode
        self.system_prompt = system_prompt
        self.max_kv_size = max_kv_size
        self._cancel = threading.Event()
        self._active: tuple | None = None
        self.reset()

    # -- state -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise SessionError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        self._mode = mode

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self._claim()
        self.tokens: list[int] = []
        self.messages: list[dict] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        self._models = {
            "source": _Model("source", self.pair.source, _new_cache(self.pair.source)),
            "target": _Model("target", self.pair.target, _new_cache(self.pair.target)),
        }
        self.turns: list[TurnStats] = []
        self.switches: list[Switch] = []
        self.retemplated = 0  # times a template was not prefix-stable (caches trimmed)
        self._user_start: int | None = None  # where an unanswered user message starts
        self._answer: tuple[int, str] | None = None  # (start, model) of the last answer

    def held(self, model: str) -> int:
        """How many conversation tokens `model`'s cache holds."""
        return self._models[self._name(model)].held

    @property
    def last_turn(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    @property
    def pending(self) -> bool:
        """True when the conversation ends with a user message that has no answer yet."""
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def cache(self, model: str) -> list:
        """The mlx-lm cache of `model` (holds `held(model)` tokens). Do not modify it."""
        return self._models[self._name(model)].cache

    def translated_spans(self, into: str | None = None) -> list[tuple[str, int, int]]:
        """Every span translated so far as (into, start, end), in order."""
        out = [(s.into, *s.translated_span) for s in self.switches if s.translated]
        return [t for t in out if into is None or t[0] == self._name(into)]

    def stats(self) -> dict:
        """Totals over the conversation, per model and per direction."""
        per = {}
        for name in MODELS:
            turns = [t for t in self.turns if t.model == name]
            sw = [s for s in self.switches if s.into == name]
            per[name] = {
                "turns": len(turns),
                "generated_tokens": sum(t.generation_tokens for t in turns),
                "prompt_tokens": sum(t.prompt_tokens for t in turns),
                "switches_into": len(sw),
                "translated_into": sum(s.translated for s in sw),
                "retranslated_into": sum(s.retranslated for s in sw),
                "translate_ms": 1e3 * sum(s.seconds for s in sw if s.translated),
                "held": self._models[name].held,
            }
        return {
            "mode": self.mode,
            "conversation_tokens": len(self.tokens),
            "messages": len(self.messages),
            "switches": len(self.switches),
            "retemplated": self.retemplated,
            "models": per,
        }

    def cancel(self) -> None:
        """Ask the running generation to stop after its current token (any thread)."""
        self._cancel.set()

    # -- messages ----------------------------------------------------------------------------

    def add_user(self, text: str) -> list[int]:
        """Append a user message (and the template's generation prompt); return its tokens.

        An earlier user message that never got an answer (generation stopped before its first
        token) is replaced.
        """
        self._claim()
        if self.pending and self._user_start is not None:
            self._truncate(self._user_start)
            self.messages.pop()
        start = self._append_message({"role": "user", "content": text}, True)
        self._user_start = start
        return self.tokens[start:]

    def add_tokens(self, tokens: Sequence[int]) -> None:
        """Append raw token ids to the conversation (no template; for tests and tools)."""
        self._claim()
        self.tokens.extend(int(t) for t in tokens)

    def _has_template(self) -> bool:
        tok = self.pair.tokenizer
        has = getattr(tok, "has_chat_template", None)
        return bool(getattr(tok, "chat_template", None)) if has is None else has

    def _template(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        tok = self.pair.tokenizer
        if self._has_template():
            out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            if not isinstance(out, list):  # BatchEncoding from some transformers versions
                out = out["input_ids"]
            return list(out)
        out: list[int] = []
        for i, m in enumerate(messages):  # no template: the contents, one line each
            out += tok.encode(m["content"] + "\n", add_special_tokens=i == 0)
        return out

    def _render(self, messages: list[dict], generation_prompt: bool) -> str | None:
        tok = self.pair.tokenizer
        if not self._has_template():
            return None
        return tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _append_message(self, message: dict, generation_prompt: bool) -> int:
        """Append `message` as the tokens the chat template adds; return where they start.

        1. token diff: the templated conversation extends the tokens so far;
        2. text diff: the templated text extends the decoded conversation (answers whose
           re-tokenization differs from the generated tokens), encode only the new text;
        3. otherwise re-tokenize everything and trim both caches to the common prefix.
        """
        messages = self.messages + [message]
        full = self._template(messages, generation_prompt)
        n = len(self.tokens)
        if full[:n] == self.tokens:
            self.tokens = full
            start = n
        else:
            new = self._text_diff(messages, generation_prompt)
            if new is not None:
                self.tokens = self.tokens + new
                start = n
            else:
                before = self._template(self.messages, message["role"] == "assistant")
                common = _common_prefix(self.tokens, full)
                start = len(before) if full[: len(before)] == before else common
                self._truncate(common)
                self.tokens = full
                self.retemplated += 1
        self.messages.append(message)
        return start

    def _text_diff(self, messages: list[dict], generation_prompt: bool) -> list[int] | None:
        """The new message's tokens from the templated text, or None if that is not possible.

        After a generated answer, anchor on the answer's text: whatever the template puts
        after it (closing the turn, the new message) is encoded and appended, so answers
        whose re-tokenization differs from the generated tokens keep their cache.
        """
        tok = self.pair.tokenizer
        text = self._render(messages, generation_prompt)
        if text is None:
            return None
        last = self.messages[-1] if self.messages else None
        if self._answer is not None and last and last["role"] == "assistant" and last["content"]:
            prev = self._render(self.messages, False)
            pos = prev.rfind(last["content"])
            head = prev[: pos + len(last["content"])] if pos >= 0 else None
            if head is not None and text.startswith(head):
                tail = text[len(head) :]
                if self.tokens and self.tokens[-1] in tok.eos_token_ids:
                    eos = tok.decode([self.tokens[-1]])
                    tail = tail[len(eos) :] if eos and tail.startswith(eos) else tail
                return list(tok.encode(tail, add_special_tokens=False)) if tail else []
        done = tok.decode(self.tokens)
        if text.startswith(done) and len(text) > len(done):
            return list(tok.encode(text[len(done) :], add_special_tokens=False))
        return None

    def _truncate(self, n: int) -> None:
        """Cut the conversation to its first n tokens and both caches with it."""
        self.tokens = self.tokens[:n]
        for m in self._models.values():
            self._settle(m, min(m.held, n))
        if self._answer and self._answer[0] >= n:
            self._answer = None

    # -- catching up -------------------------------------------------------------------------

    def _name(self, model: str) -> str:
        try:
            return ALIASES[model]
        except KeyError:
            raise SessionError(
                f"unknown model {model!r}; use 'source'/'small' or 'target'/'large'"
            ) from None

    @staticmethod
    def _settle(m: _Model, want: int) -> None:
        """Make every layer of m's cache hold exactly the first `keep` tokens it can vouch for.

        After an interruption some layers may have processed more than others; keeping the
        smallest count over layers (and at most `want`) leaves a consistent cache.
        """
        keep = min([want] + [c.offset for c in m.cache])
        for c in m.cache:
            if c.offset > keep:
                c.trim(c.offset - keep)
        m.held = keep

    def _catch_up(self, name: str, upto: int) -> Switch | None:
        """Bring model `name` to hold conversation[:a] with a <= upto, by the session's mode.

        Returns the `Switch` when the other model held tokens this one lacked, else None.
        """
        m = self._models[name]
        o = self._models["target" if name == "source" else "source"]
        self._settle(m, min(m.held, upto))
        end = min(o.held, upto)
        if end <= m.held:
            return None
        sw = Switch(name, self.mode, m.held, end)
        tr = self.forward if name == "target" else self.backward
        if self.mode == "reprefill":
            sw.note = "re-prefill"
        elif tr is None:
            sw.note = f"no {'forward' if name == 'target' else 'backward'} translator: re-prefill"
        else:
            t0 = time.perf_counter()
            cut = tr.config.key_cut
            if self.mode == "naive":
                sw.retranslated = m.held
                m.cache, m.held = _new_cache(m.loaded), 0
            span = self._capture(o, m.held, end, cut)
            span.tokens = tuple(self.tokens[span.start : span.end])
            keys, values = tr.translate(span, m.loaded)
            append_kv(m.cache, keys, values)
            m.held = end
            sw.translated = span.length
            sw.seconds = time.perf_counter() - t0
        self.switches.append(sw)
        return sw

    def _capture(self, o: _Model, start: int, end: int, cut: str) -> SpanKV:
        """The outgoing model's K/V for [start, end) at the translator's key cut."""
        if not needs_recording(o.loaded, cut):
            return capture_from_cache(o.loaded, o.cache, start, end)
        # pre-k_norm keys are not in the cache: recompute the span on the cached prefix
        scratch = _prefix_copy(o.cache, start)
        return prefill(o.loaded, self.tokens[start:end], scratch, cut=cut)

    def _check_mode(self) -> None:
        if self.mode != "naive":
            return
        for tr, outgoing in ((self.forward, self.pair.source), (self.backward, self.pair.target)):
            if tr is not None and needs_recording(outgoing, tr.config.key_cut):
                raise SessionError(
                    "naive mode needs post_norm translators (with a pre_norm one the outgoing "
                    "model would recompute its keys, hiding the re-translation drift)"
                )

    def _check_room(self, name: str) -> int | None:
        """Tokens this turn may still add under `max_kv_size` (None: unlimited)."""
        if self.max_kv_size is None:
            return None
        room = self.max_kv_size - len(self.tokens)
        if room < 1:
            raise ContextOverflowError(
                f"the conversation is {len(self.tokens)} tokens, the {name} model's context "
                f"limit is {self.max_kv_size} (max_kv_size): drop the oldest turns with "
                f"/trim (Session.trim) or start over with /reset"
            )
        return room

    def _claim(self) -> None:
        """Refuse concurrent use; close a generation this thread abandoned (commits it)."""
        if getattr(self, "_active", None) is None:
            return
        gen, owner = self._active
        if owner != threading.get_ident() or gen.gi_running:
            raise SessionBusyError(
                "a generation is running on this session; cancel() it or wait for it to end"
            )
        self._active = None
        gen.close()

    # -- answering ---------------------------------------------------------------------------

    def generate(
        self,
        model: str = "target",
        *,
        max_tokens: int = 256,
        sampler=None,
        logits_processors=None,
        prefill_step_size: int = 2048,
    ) -> Iterator[TokenEvent]:
        """Stream an answer from `model` ('source'/'small' or 'target'/'large').

        The model first catches up on what it lacks (see the module docstring), then decodes
        with mlx-lm. Stopping early (break, `cancel()`, KeyboardInterrupt, closing the
        iterator) commits the tokens emitted so far and trims the cache to match.
        """
        name = self._name(model)
        self._claim()
        if not self.tokens:
            raise SessionError("nothing to answer yet: add a user message first")
        self._check_mode()
        room = self._check_room(name)
        limit = max_tokens
        if room is not None and (max_tokens < 0 or max_tokens > room):  # -1: no limit
            limit = room
        self._cancel.clear()
        kwargs = dict(sampler=sampler, logits_processors=logits_processors)
        kwargs["prefill_step_size"] = prefill_step_size
        gen = self._generate(name, limit, limit != max_tokens, kwargs)
        self._active = (gen, threading.get_ident())
        return gen

    def _generate(self, name: str, limit: int, capped: bool, kwargs) -> Iterator[TokenEvent]:
        m = self._models[name]
        t0 = time.perf_counter()
        n0 = len(self.tokens)
        stats = TurnStats(name, self.mode)
        emitted: list[int] = []
        texts: list[str] = []
        try:
            stats.switch = self._catch_up(name, n0 - 1)
            prompt = self.tokens[m.held :]
            stats.prompt_tokens = len(prompt)
            stream = stream_generate(
                m.loaded.model,
                self.pair.tokenizer,
                mx.array(prompt),
                max_tokens=limit,
                prompt_cache=m.cache,
                **kwargs,
            )
            try:
                for r in stream:
                    if stats.ttft_s is None:
                        stats.ttft_s = time.perf_counter() - t0
                    lp = r.logprobs[r.token].item()
                    emitted.append(r.token)
                    texts.append(r.text)
                    stats.logprobs.append(lp)
                    stats.generation_tokens = r.generation_tokens
                    stats.generation_tps = r.generation_tps
                    stats.prompt_tps = r.prompt_tps
                    stats.peak_memory_gb = r.peak_memory
                    if r.finish_reason is not None:
                        stats.finish_reason = r.finish_reason
                        if capped and r.finish_reason == "length":
                            stats.finish_reason = "context"
                        stats.text = "".join(texts)
                        yield TokenEvent(r.text, r.token, lp, name, stats)
                        break
                    if self._cancel.is_set():
                        stats.finish_reason = "cancelled"
                        stats.text = "".join(texts)
                        yield TokenEvent(r.text, r.token, lp, name, stats)
                        break
                    yield TokenEvent(r.text, r.token, lp, name)
            finally:
                stream.close()
        finally:
            self._commit(m, n0, emitted, texts, stats)

    def _commit(self, m: _Model, n0: int, emitted, texts, stats: TurnStats) -> None:
        """End a turn: keep the emitted tokens as the answer and make the cache match."""
        stats.finish_reason = stats.finish_reason or "interrupted"
        stats.text = "".join(texts)
        if emitted:
            self.tokens = self.tokens[:n0] + list(emitted)
            last = self.messages[-1] if self.messages else None
            if last is not None and last["role"] == "assistant" and self._answer is not None:
                last["content"] += stats.text  # a continuation of the last answer
            else:
                self.messages.append({"role": "assistant", "content": stats.text})
                self._answer = (n0, m.name)
            self._user_start = None
        self._settle(m, len(self.tokens))
        self.turns.append(stats)
        if self._active is not None and self._active[1] == threading.get_ident():
            self._active = None

    def escalate(self, model: str | None = None, **generate_kwargs) -> Iterator[TokenEvent]:
        """Answer the last user message again with the other model (or `model`).

        The last answer is dropped from the conversation and both caches; the incoming model
        then catches up by the session's mode and answers.
        """
        self._claim()
        if self.pending:  # e.g. stopped before its first token: the other model answers it
            if model is None and self.last_turn is None:
                raise SessionError("the last message has no answer yet: name the model to answer")
            into = model or ("target" if self.last_turn.model == "source" else "source")
            return self.generate(into, **generate_kwargs)
        if self._answer is None or not self.messages or self.messages[-1]["role"] != "assistant":
            raise SessionError("nothing to escalate: there is no answer yet")
        start, answered = self._answer
        into = self._name(model) if model else ("target" if answered == "source" else "source")
        self._truncate(start)
        self.messages.pop()
        self._answer = None
        self._user_start = None
        return self.generate(into, **generate_kwargs)

    def score(self, model: str, text: str, prefill_step_size: int = 2048) -> list[float]:
        """Teacher forcing: append `text` as `model`'s answer; return its tokens' log-probs.

        The model catches up exactly as it would before answering, then reads the answer
        itself. Used by the multi-turn evaluation (NLL of the real next turn).
        """
        name = self._name(model)
        self._claim()
        if not self.tokens:
            raise SessionError("nothing to answer yet: add a user message first")
        self._check_mode()
        m = self._models[name]
        stats = TurnStats(name, self.mode, finish_reason="scored")
        t0 = time.perf_counter()
        start = self._append_message({"role": "assistant", "content": text}, False)
        if self.max_kv_size is not None and len(self.tokens) > self.max_kv_size:
            n = len(self.tokens)
            self._truncate(start)
            self.messages.pop()
            raise ContextOverflowError(
                f"with this answer the conversation is {n} tokens, beyond max_kv_size "
                f"{self.max_kv_size}: /trim (Session.trim) or /reset"
            )
        self._user_start = None
        self._answer = (start, name)
        try:
            stats.switch = self._catch_up(name, start - 1)
            a = m.held
            toks = self.tokens[a:]
            stats.prompt_tokens = start - a  # read before the answer; the answer is "generated"
            out: list[float] = []
            for s in range(0, len(toks), prefill_step_size):
                chunk = toks[s : s + prefill_step_size]
                logits = m.loaded.model(mx.array(chunk)[None], cache=m.cache)[0]
                logp = logits.astype(mx.float32) - mx.logsumexp(
                    logits.astype(mx.float32), axis=-1, keepdims=True
                )
                # absolute position p = a + s + i predicts token p + 1; want p + 1 >= start
                lo = max(start - 1 - (a + s), 0)
                hi = min(len(chunk), len(self.tokens) - 1 - (a + s))
                if hi > lo:
                    targets = mx.array(self.tokens[a + s + lo + 1 : a + s + hi + 1])
                    picked = mx.take_along_axis(logp[lo:hi], targets[:, None], axis=-1)[:, 0]
                    out.extend(picked.tolist())
                mx.eval([c.keys for c in m.cache])
            stats.logprobs = out
            stats.generation_tokens = len(self.tokens) - start
            stats.ttft_s = time.perf_counter() - t0
            stats.text = text
        finally:
            self._settle(m, len(self.tokens))
            self.turns.append(stats)
        return out

    # -- keeping within the context ----------------------------------------------------------

    def trim(self, max_tokens: int | None = None) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens.

        Default: half of `max_kv_size`. The system prompt and the last message stay. Later
        tokens move to new positions, so both caches are cut to the prefix the shortened
        conversation shares with the old one (usually the system prompt) and the next
        answering model re-reads the rest. Returns the number of messages dropped.
        """
        self._claim()
        if max_tokens is None:
            if self.max_kv_size is None:
                raise SessionError("trim needs a token budget (or a session max_kv_size)")
            max_tokens = self.max_kv_size // 2
        head = (
            self.messages[:1] if self.messages[:1] and self.messages[0]["role"] == "system" else []
        )
        rest = self.messages[len(head) :]
        dropped = 0
        gp = bool(rest) and rest[-1]["role"] == "user"
        while len(rest) > 1 and len(self._template(head + rest, gp)) > max_tokens:
            rest = rest[1:]
            dropped += 1
            while len(rest) > 1 and rest[0]["role"] != "user":  # start on a user turn
                rest = rest[1:]
                dropped += 1
        if not dropped:
            return 0
        full = self._template(head + rest, gp)
        if len(full) > max_tokens:
            raise ContextOverflowError(
                f"even the last message alone is {len(full)} tokens, over the {max_tokens} budget"
            )
        self._truncate(_common_prefix(self.tokens, full))
        self.tokens = full
        self.messages = head + rest
        self._answer = None
        self._user_start = None
        if gp:  # the kept last message awaits its answer
            before = self._template(head + rest[:-1], False) if head or rest[:-1] else []
            if full[: len(before)] == before:
                self._user_start = len(before)
        return dropped

    # -- saving ------------------------------------------------------------------------------

    def _identity(self) -> dict:
        def side(loaded):
            return {
                "name": loaded.name,
                "geometry": loaded.geometry.as_dict(),
                "fingerprint": model_fingerprint(loaded),
            }

        return {
            "source": side(self.pair.source),
            "target": side(self.pair.target),
            "tokenizer": self.pair.tokenizer_fingerprint,
        }

    def save(self, path: str | Path) -> Path:
        """Write both caches, the conversation and the sync state to one prompt cache file.

        The file is an mlx-lm prompt cache (`mlx_lm.models.cache.load_prompt_cache` reads it):
        the source's layers, then the target's; metadata `kvlingo_session` holds the rest.
        A `.safetensors` suffix is added when missing.
        """
        self._claim()
        path = Path(path)
        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        state = {
            "schema": SESSION_SCHEMA,
            "schema_version": SESSION_SCHEMA_VERSION,
            **self._identity(),
            "layers": [self.pair.source.geometry.layers, self.pair.target.geometry.layers],
            "held": {n: m.held for n, m in self._models.items()},
            "tokens": self.tokens,
            "messages": self.messages,
            "system_prompt": self.system_prompt,
            "mode": self.mode,
            "answer": list(self._answer) if self._answer else None,
            "user_start": self._user_start,
            "switches": [asdict(s) for s in self.switches],
            "turns": [{**asdict(t), "logprobs": []} for t in self.turns],
        }
        caches = []
        for name in MODELS:
            m = self._models[name]
            caches += _prefix_copy(m.cache, m.held)
        meta = {"kvlingo_session": json.dumps(state), "model": self.pair.target.name}
        tmp = path.with_name(path.name + ".tmp.safetensors")
        save_prompt_cache(str(tmp), caches, meta)
        os.replace(tmp, path)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a session saved by `save` for this same pair (refuses any other pair)."""
        self._claim()
        path = Path(path)
        if not path.is_file() and path.with_name(path.name + ".safetensors").is_file():
            path = path.with_name(path.name + ".safetensors")
        if not path.is_file():
            raise SessionFileError(f"{path}: no such session file")
        try:
            caches, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
            raise SessionFileError(f"{path}: not a readable prompt cache file ({e})") from None
        raw = meta.get("kvlingo_session")
        if raw is None:
            raise SessionFileError(
                f"{path}: an mlx-lm prompt cache without kvlingo session state "
                "(write session files with /save or Session.save)"
            )
        state = json.loads(raw)
        if state.get("schema") != SESSION_SCHEMA or state.get("schema_version") != (
            SESSION_SCHEMA_VERSION
        ):
            raise SessionFileError(
                f"{path}: unsupported session schema {state.get('schema')!r} "
                f"v{state.get('schema_version')!r}"
            )
        mine = self._identity()
        for side in MODELS:
            theirs = state[side]
            ours = mine[side]
            if (
                theirs["geometry"] != ours["geometry"]
                or theirs["fingerprint"] != (ours["fingerprint"])
            ):
                raise SessionFileError(
                    f"{path}: saved with {side} model {theirs['name']} "
                    f"({state['source']['name']} -> {state['target']['name']}); this session's "
                    f"{side} is {ours['name']}: a session file only loads into the pair that "
                    "wrote it"
                )
        if state.get("tokenizer") and state["tokenizer"] != mine["tokenizer"]:
            raise SessionFileError(f"{path}: saved with a different tokenizer")
        ls, lt = state["layers"]
        if len(caches) != ls + lt:
            raise SessionFileError(f"{path}: holds {len(caches)} cache layers, expected {ls + lt}")
        models = {
            "source": _Model("source", self.pair.source, caches[:ls], state["held"]["source"]),
            "target": _Model("target", self.pair.target, caches[ls:], state["held"]["target"]),
        }
        for m in models.values():
            if any(c.offset != m.held for c in m.cache) or m.held > len(state["tokens"]):
                raise SessionFileError(f"{path}: {m.name} cache disagrees with its sync state")
        self._models = models
        self.tokens = list(state["tokens"])
        self.messages = list(state["messages"])
        self.system_prompt = state.get("system_prompt")
        self._answer = tuple(state["answer"]) if state.get("answer") else None
        self._user_start = state.get("user_start")
        self.switches = [Switch(**s) for s in state.get("switches", [])]
        self.turns = [
            TurnStats(**{**t, "switch": Switch(**t["switch"]) if t["switch"] else None})
            for t in state.get("turns", [])
        ]
