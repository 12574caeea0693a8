"""Catching up: a model about to answer gets the span the other model holds and it lacks.

Invariant: each model's `ModelCache` holds conversation[:held] in every layer, and nothing
here leaves it otherwise, however it stops (cancel, Ctrl-C: `ModelCache.settle`). A span is a
range [start, end) of conversation positions; it is translated at its true positions, once:

    alternation  translate only [held, other's held) (naive: everything the other holds, the
                 drifting baseline; reprefill: none, the model reads it itself);
    reader       who reads a new turn for the large model (reader.py): the small model
                 (`small_reads`, then `catch_up`, then the large reads the tail and
                 `recompute`s) or the large itself;
    ahead        while the small model answers, translate for the large between its tokens.

Key cut: the span is read from the outgoing model's cache and un-rotated exactly (`post_norm`).
A `pre_norm` translator on a k_norm family needs the keys before k_norm, which caches do not
keep: the outgoing model recomputes the span on its cached prefix to record them. Naive mode
refuses such a translator: recomputing would quietly undo the compounding it exists to show.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from mlx_kvlingo.conversation.reader import RECOMPUTE_SELECTION
from mlx_kvlingo.conversation.transcript import Read, SessionError, Switch
from mlx_kvlingo.kv.cache import append_kv, new_cache, prefix_copy, reserve
from mlx_kvlingo.kv.capture import SpanKV, needs_recording, prefill
from mlx_kvlingo.kv.recompute import (
    read_positions,
    recompute_attended,
    sentence_ends,
    special_ids,
)
from mlx_kvlingo.kv.translator import Side, Translator, append_translation
from mlx_kvlingo.models.pair import LoadedModel, ModelPair

import mlx.core as mx

#: translating ahead: at least AHEAD_MIN tokens at a time, at most AHEAD_SHARE of the small
#: model's decode time (conversation/README.md, "Translating ahead")
AHEAD_MIN, AHEAD_SHARE = 8, 0.10
#: a turn is read (by either model) and its span captured and translated this many tokens at a
#: time: one chunk's scores and maps beside the caches however long the turn
READ_CHUNK = 512
#: the bound on one read chunk's float32 attention scores (the chunk's rows over the cache, every
#: query head), which MLX's CPU backend materializes beside the caches
SCORES_BYTES = 64 << 20


def read_chunk(heads: int, held: int, chunk: int = READ_CHUNK) -> int:
    """Tokens n the next read chunk takes with `held` tokens cached: `chunk`, or fewer where
    n x (held + chunk) x `heads` x 4 bytes (at least its scores) would pass `SCORES_BYTES`;
    never fewer than chunk // 8."""
    return max(chunk // 8, min(chunk, SCORES_BYTES // (4 * heads * (held + chunk))))


class RemoteLarge(Protocol):
    """The large model's cache where it lives on other ranks (the pipelined target,
    distributed/): a session gathers spans from it and places translated spans into it."""

    def gather(self, cache: list, start: int, end: int) -> SpanKV: ...

    def place(self, cache: list, span: SpanKV) -> None: ...


@dataclass
class ModelCache:
    """One model of the pair and its mlx-lm cache, which holds conversation[:held]."""

    name: str  # "source" or "target"
    loaded: LoadedModel
    cache: list
    held: int = 0

    def clear(self) -> None:
        self.cache, self.held = new_cache(self.loaded), 0

    def settle(self, want: int) -> None:
        """Make every layer hold exactly the first tokens all layers hold (at most `want`): after
        an interruption some layers may have processed more than others."""
        keep = min([want] + [c.offset for c in self.cache])
        for c in self.cache:
            if c.offset > keep:
                c.trim(c.offset - keep)
        self.held = keep


def check_directions(pair: ModelPair, forward: Translator | None, backward: Translator | None):
    """`forward` maps the small model's K/V into the large one's, `backward` the other way."""
    src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    for label, tr, a, b in (("forward", forward, src, tgt), ("backward", backward, tgt, src)):
        if tr is not None and (tr.config.source, tr.config.target) != (a, b):
            raise SessionError(
                f"the {label} translator maps {tr.config.source} -> {tr.config.target}, "
                f"but this direction needs {a} -> {b}"
            )


def check_mode(mode: str, pair: ModelPair, forward, backward) -> None:
    """Naive mode refuses a translator whose keys the outgoing model recomputes ("Key cut")."""
    for tr, outgoing in ((forward, pair.source), (backward, pair.target)):
        if mode == "naive" and tr and needs_recording(outgoing, tr.config.key_cut):
            raise SessionError(
                "naive mode needs post_norm translators (with a pre_norm one the outgoing "
                "model would recompute its keys, hiding the re-translation drift)"
            )


class CatchUp:
    """The session's catching up (a base of `Session`, whose state it acts on: `pair`,
    `forward`, `backward`, `remote`, `transcript` (only read), `models`, `switches`, `cancelled`,
    `mode`, `policy`, `read_costs`); who reads a turn: reader.py."""

    # -- catching up ------------------------------------------------------------------------

    def catch_up(self, name: str, upto: int) -> Switch | None:
        """Bring model `name` to hold conversation[:a] with a <= upto, by the mode; the `Switch`
        where the other model held tokens this one lacked, else None."""
        m = self.models[name]
        o = self.models["target" if name == "source" else "source"]
        m.settle(min(m.held, upto))
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
            if self.mode == "naive":
                sw.retranslated = m.held
                m.clear()
            self._translate(o, m, tr, m.held, end)
            sw.translated = end - sw.start + sw.retranslated  # naive: from 0
            sw.seconds = time.perf_counter() - t0
        self.switches.append(sw)
        return sw

    def _translate(self, o: ModelCache, m: ModelCache, tr, start: int, end: int) -> None:
        """Append the translation of o's K/V for [start, end) to m (which holds [0, start)),
        `READ_CHUNK` tokens at a time where both caches are here and o's cache holds the
        keys the translator reads; m holds whole chunks however it stops."""
        cut = tr.config.key_cut
        whole = self.remote is not None or needs_recording(o.loaded, cut)
        chunk = end - start if whole else READ_CHUNK
        try:
            for s in range(start, end, chunk):
                e = min(end, s + chunk)
                span = self._capture(o, tr, s, e)
                span.tokens = tuple(self.transcript.tokens[s:e])
                if m.name == "target" and self.remote is not None:
                    self.remote.place(m.cache, span)
                else:
                    append_translation(m.loaded, tr, span, m.cache)
                m.held = e
        finally:
            m.settle(m.held)  # an interrupted append leaves no half-written layer

    def _capture(self, o: ModelCache, tr: Translator, start: int, end: int) -> SpanKV:
        """o's RoPE-free K/V for [start, end) at `tr`'s key cut (read from the cache: of the
        layers `tr` reads only)."""
        cut = tr.config.key_cut
        if o.name == "target" and self.remote is not None:
            if needs_recording(o.loaded, cut):
                raise SessionError(
                    "a pre_norm backward translator is not available with a pipelined large "
                    "model (it would recompute the large model's keys); use a post_norm one"
                )
            return self.remote.gather(o.cache, start, end)
        if not needs_recording(o.loaded, cut):
            return tr.capture(o.loaded, o.cache, start, end)
        # pre-k_norm keys are not in the cache: recompute the span on the prefix
        return prefill(o.loaded, self.transcript.tokens[start:end], prefix_copy(o.cache, start),
                       cut=cut)  # fmt: skip

    def small_reads(self, upto: int, chunk: int, progress=None) -> Read:
        """The small model catches up on the large's last answer, then reads up to `upto`
        itself (prefill only), `chunk` tokens at a time or fewer on a long cache (`read_chunk`);
        a cancel stops it between chunks.
        However it stops (cancel, Ctrl-C), its cache holds exactly what it read.
        `progress("source", done, total)` is called before the first chunk and after each."""
        m = self.models["source"]
        read = Read("source", catch_up=self.catch_up("source", upto), start=m.held)
        reserve(m.loaded, m.cache, upto)  # no layer grows (2x its size) while it reads
        t0, total = time.perf_counter(), max(upto - m.held, 0)
        try:
            while m.held < upto and not self.cancelled.is_set():
                if progress is not None:
                    progress("source", read.tokens, total)
                n = read_chunk(m.loaded.query_heads, m.held, chunk)
                piece = self.transcript.tokens[m.held : min(upto, m.held + n)]
                m.loaded.model(mx.array(piece)[None], cache=m.cache)
                mx.eval([c.keys for c in m.cache])
                m.held += len(piece)
                read.tokens += len(piece)
            if progress is not None and total:
                progress("source", read.tokens, total)
        finally:
            m.settle(m.held)
            read.seconds = time.perf_counter() - t0
        return read

    def recompute(self, sw: Switch, n0: int) -> None:
        """After translating `sw`'s span into the large model (its cache now holds [0, cut)):
        it reads conversation[cut:n0] itself and recomputes the `recompute_share` of the span
        its reading attended to most (`recompute.recompute_attended`). The cache is left
        holding [0, n0 - 1): the answer reads the last token. Interrupted, the cache keeps
        [0, cut) (some of its positions recomputed in some layers: K/V of the target's own
        either way)."""
        m = self.models["target"]
        cut, toks, tok = m.held, self.transcript.tokens[:n0], self.pair.tokenizer
        t0 = time.perf_counter()
        votes = self._small_votes(toks, cut) if RECOMPUTE_SELECTION.votes else None
        try:
            append_kv(m.cache, *_placeholders(m.cache, n0 - cut))
            chosen = recompute_attended(m.loaded.model, m.cache, toks, n0 - cut,
                                        self.policy.recompute_share, start=cut - sw.translated,
                                        selection=RECOMPUTE_SELECTION, ends=sentence_ends(tok),
                                        specials=special_ids(tok), votes=votes)  # fmt: skip
            m.held = n0 - 1
        finally:
            m.settle(m.held)
        sw.recomputed, sw.tail_read = len(chosen), n0 - cut
        sw.recompute_s = time.perf_counter() - t0

    def _small_votes(self, toks: list[int], cut: int) -> mx.array:
        """The small model reads toks[cut:] over the cache it holds [0, cut) of, and returns
        the attention its reading put on each position (`read_positions`): it then holds
        toks. Interrupted, it keeps [0, cut)."""
        s = self.models["source"]
        s.settle(cut)
        try:
            append_kv(s.cache, *_placeholders(s.cache, len(toks) - cut))
            votes = read_positions(s.loaded.model, s.cache, toks, range(cut, len(toks)), True)
            s.held = len(toks)
        finally:
            s.settle(s.held)
        return votes

    # -- translating ahead (cascade) ----------------------------------------------------------

    def ahead_begin(self, upto: int) -> Switch | None:
        """While the small model answers, the span the large would lack on escalation,
        [large's held, upto), is translated chunk by chunk between the small model's tokens
        (`ahead_step`). Kept either way: it is a prefix of the conversation, so alternation
        stays exact and no span is translated twice."""
        p = self.policy
        if not (p.translate_ahead and self.forward is not None and self.mode == "alternation"):
            return None
        t = self.models["target"]
        t.settle(min(t.held, upto))
        if t.held >= upto:
            return None
        self.ahead_credit = min(self.ahead_credit, 0.0)  # a debt carries over, credit does not
        return Switch("target", self.mode, t.held, t.held, note=f"translated ahead to {upto}")

    def ahead_step(self, sw: Switch, upto: int, decode_s: float | None) -> float:
        """After one small token (decoded in `decode_s`, None for the first): translate the
        next chunk of the ahead span (`ahead_tokens`). Returns the seconds spent."""
        t, o = self.models["target"], self.models["source"]
        read = min(c.offset for c in o.cache)  # the small model's cache, mid-answer
        n = self.ahead_tokens(min(upto, read) - t.held, decode_s)
        if n <= 0:
            return 0.0
        t0 = time.perf_counter()
        self._translate(o, t, self.forward, t.held, t.held + n)
        seconds = time.perf_counter() - t0
        self.ahead_credit -= seconds
        self.read_costs.forward.observe(n, seconds)
        if not sw.translated:
            self.switches.append(sw)
        sw.end = t.held
        sw.translated = sw.end - sw.start
        sw.seconds += seconds
        return seconds

    def ahead_tokens(self, remaining: int, decode_s: float | None) -> int:
        """How many of `remaining` tokens to translate ahead now. Each small token earns
        AHEAD_SHARE x its decode time; a chunk is translated once the credit covers its
        predicted cost (`read_costs.forward`: a + b n) and it is at least max(AHEAD_MIN, 3a / b)
        tokens (its per-call cost a quarter at most), as many as the credit covers; what it
        overruns is a debt. Unmeasured: AHEAD_MIN tokens."""
        cost = self.read_costs.forward
        if remaining <= 0:
            return 0
        self.ahead_credit += AHEAD_SHARE * max(decode_s or 0.0, 0.0)
        if self.ahead_credit <= 0 or not cost.samples:  # the first chunk measures
            return 0 if self.ahead_credit <= 0 else min(remaining, AHEAD_MIN)
        a, b = cost.fit()
        b = max(b, 1e-9)
        # one length measured: twice it, which tells the per-call cost from the per-token one
        least = max(AHEAD_MIN, math.ceil(3 * a / b)) if cost.ready else 2 * cost.samples[-1][0]
        most = min(remaining, int((self.ahead_credit - a) / b))
        return most if most >= min(least, remaining) else 0


def _placeholders(cache: list, n: int) -> tuple[list, list]:
    """Zero K/V for `n` positions per layer, overwritten before anything attends to them."""
    keys = [mx.zeros((*c.keys.shape[:2], n, c.keys.shape[-1]), dtype=c.keys.dtype) for c in cache]
    vals = [mx.zeros((*c.values.shape[:2], n, c.values.shape[-1]), dtype=c.values.dtype)
            for c in cache]  # fmt: skip
    return keys, vals
