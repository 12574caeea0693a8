"""Answering: catch up, read the rest, decode with mlx-lm, commit what was emitted.

A turn always ends in `_commit`, however it stops (end, max tokens, `cancel()`, Ctrl-C, the
iterator closed or garbage collected): the emitted tokens become the answer and the cache is
cut to match, so both caches stay consistent. One generation at a time per session.
Mixed into `Session`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from mlx_kvlingo.conversation.catchup import _Model
from mlx_kvlingo.conversation.records import (
    ContextOverflowError,
    SessionBusyError,
    SessionError,
    TokenEvent,
    TurnStats,
)
from mlx_kvlingo.kv.cache import new_cache

import mlx.core as mx
from mlx_lm import stream_generate


class Answering:
    """Generation, escalation and teacher-forced scoring (state lives on `Session`)."""

    def _check_room(self, name: str) -> int | None:
        """Tokens this turn may still add under `max_kv_size` and both models' own context
        (None: unlimited). A conversation already past either model's context is refused
        before any work: both may read it."""
        n = len(self.tokens)
        for label, m in (("small", self.pair.source), ("large", self.pair.target)):
            limit = m.context_length
            if limit is not None and n > limit:
                raise ContextOverflowError(
                    f"the conversation is {n} tokens; the {label} model ({m.name}) handles at "
                    f"most {limit}: shorten the message, drop the oldest turns with /trim "
                    f"(Session.trim) or start over with /reset"
                )
        if self.max_kv_size is None:
            return None
        room = self.max_kv_size - n
        if room < 1:
            raise ContextOverflowError(
                f"the conversation is {n} tokens, the {name} model's context "
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
        paths = None
        try:
            paths = self._hand_off(name, n0, stats, min(kwargs["prefill_step_size"], 512))
            if stats.finish_reason == "cancelled":
                return
            ahead = self._ahead_begin(n0 - 1) if name == "source" else None
            stats.ahead = ahead
            prompt = self.tokens[m.held :]
            stats.prompt_tokens = len(prompt)
            procs = kwargs.get("logits_processors")
            if procs:  # they see the earlier answers and this one, not only this turn's
                kwargs = {**kwargs, "logits_processors": _over_answers(procs, self._answers())}
            stream = stream_generate(
                m.loaded.model,
                self.pair.tokenizer,
                mx.array(prompt),
                max_tokens=limit,
                prompt_cache=m.cache,
                **kwargs,
            )
            try:
                last_token_at, ahead_s = None, 0.0
                for r in stream:
                    now = time.perf_counter()
                    # the small model's decode time for this token: the wall time since the
                    # last one, less what translating ahead took in between
                    decode_s = None if last_token_at is None else now - last_token_at - ahead_s
                    last_token_at = now
                    if stats.ttft_s is None:
                        stats.ttft_s = time.perf_counter() - t0
                    lp = r.logprobs[r.token].item()
                    emitted.append(r.token)
                    texts.append(r.text)
                    stats.logprobs.append(lp)
                    stats.generation_tokens = r.generation_tokens
                    stats.generation_tps = r.generation_tps
                    stats.prompt_tps = r.prompt_tps
                    stats.prompt_s = len(prompt) / r.prompt_tps if r.prompt_tps else 0.0
                    stats.peak_memory_gb = r.peak_memory
                    if len(emitted) == 1:
                        self._observe(stats)
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
                    if ahead is not None:  # between the small model's tokens
                        ahead_s = self._ahead_step(ahead, n0 - 1, decode_s)
            finally:
                stream.close()
        finally:
            self._commit(m, n0, emitted, texts, stats)
        if emitted and paths is not None:  # the other path's TTFT, predicted with this turn's rates
            self._alternative(stats, paths, self.tokens[:n0])

    def hand_off(self, model: str = "target", chunk: int = 512) -> TurnStats:
        """Bring `model` up to the conversation, ready for its first step, without answering:
        the hand-off `generate` runs before it decodes (`_hand_off`). Its cache then holds
        conversation[:held(model)] and the rest (at least the last token) is the prompt its
        first step reads. Returns the records (who read, what was translated, recomputed)."""
        name = self._name(model)
        self._claim()
        if not self.tokens:
            raise SessionError("nothing to answer yet: add a user message first")
        self._check_mode()
        self._check_room(name)
        self._cancel.clear()
        stats = TurnStats(name, self.mode)
        self._hand_off(name, len(self.tokens), stats, chunk)
        return stats

    def _hand_off(self, name: str, n0: int, stats: TurnStats, chunk: int):
        """The one hand-off, for the model `name` about to answer conversation[:n0]:

            the small model reads the turn           (reader "small": `_read_ahead`)
            translate the span the large one lacks   (`_catch_up`)
            the large reads the turn's last tokens   (`large_reads_last`)
            and recomputes what it attended to most  (`recompute_share`: `_recompute`)

        leaving conversation[held:n0] (at least the last token) for the first step. Where the
        large reads the turn itself, only the catch-up runs. Fills `stats` (a cancel sets its
        finish_reason) and returns the predicted paths (None where no prediction applies)."""
        m = self._models[name]
        small, stats.read_note, paths = self._reader_choice(name, n0 - 1)
        if paths is not None:  # what was predicted for the path taken
            stats.predicted_ttft_s = (paths.small if small else paths.large)(self.read_costs)
        upto = n0 - 1  # the answering model reads at least the last token itself
        if small:  # the large still reads the turn's last tokens itself (_tail_cut)
            upto = self._tail_cut(n0 - 1, paths)
            stats.read = self._read_ahead(upto, chunk)
            if self._cancel.is_set():  # stopped while the small model read
                stats.finish_reason = "cancelled"
                return paths
        stats.switch = sw = self._catch_up(name, upto)
        if (
            small
            and sw is not None
            and self._recompute_count(sw.translated)
            and (paths is None or paths.recompute)
        ):  # the large reads the tail and recomputes (where its budget allows: _reading)
            self._recompute(m, sw, n0)
            if self._cancel.is_set():
                stats.finish_reason = "cancelled"
        return paths

    def _answers(self) -> list[int]:
        """The token ids of the conversation's earlier answers, oldest first."""
        tok = self.pair.tokenizer
        return [t for msg in self.messages if msg["role"] == "assistant" and msg["content"]
                for t in tok.encode(msg["content"], add_special_tokens=False)]  # fmt: skip

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

    def _alternative(self, stats: TurnStats, paths, conversation: list[int]) -> None:
        """The TTFT the other way of reading would have had, predicted from the rates this
        turn updated; the large model's own read is timed once (after the answer, on `_PROBE`
        tokens of the conversation in a scratch cache) when it never was."""
        costs = self.read_costs
        if stats.read is not None:
            if not costs.target_read.ready:
                _probe(self.pair.target, conversation, costs.target_read)
            stats.alternative_ttft_s = paths.large(costs)
            stats.alone_prefill_s = stats.alternative_ttft_s
        else:
            stats.alternative_ttft_s = paths.small(costs)

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
            self._cancel.clear()
            self._hand_off(name, start, stats, min(prefill_step_size, 512))
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


def _over_answers(processors: list, answers: list[int]) -> list:
    """Logits processors that see the conversation's answers: earlier ones, then this one.

    mlx-lm hands a processor the part of the prompt it passed last plus the tokens generated
    so far. That part depends on who read the turn (one token, the 32-token tail or the whole
    turn), and with a cache holding the conversation no earlier answer is in it, so a
    repetition penalty would let the model copy its last answer. Here the prompt part is
    dropped and the earlier answers come first: the penalty keeps answers from repeating
    themselves and never pushes an answer away from the words of the text it is about.
    """
    past = mx.array(answers, dtype=mx.int32)

    def wrap(proc):
        skip = []  # the prompt part: all that the first call gets

        def call(tokens, logits):
            if not skip:
                skip.append(tokens.size)
            return proc(mx.concatenate([past, tokens[skip[0] :]]), logits)

        return call

    return [wrap(p) for p in processors]


# -- the path not taken ---------------------------------------------------------------------

_PROBE = (16, 64)  # tokens a never-timed large model reads once each, to time it


def _probe(loaded, conversation: list[int], cost) -> None:
    for n in _PROBE:
        probe = (conversation * (n // max(len(conversation), 1) + 1))[:n]
        cache = new_cache(loaded)
        t0 = time.perf_counter()
        loaded.model(mx.array(probe)[None], cache=cache)
        mx.eval([c.keys for c in cache])
        cost.observe(n, time.perf_counter() - t0)
