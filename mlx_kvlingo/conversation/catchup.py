"""Catching up: a model that is about to answer gets the span the other model holds and it lacks.

    alternation  translate only [held, other's held) at its true positions, once;
    naive        re-translate everything the other model holds (the drifting baseline);
    reprefill    read it itself.

The span is taken from the outgoing model's cache (the `post_norm` cut), or recomputed on its
cached prefix when the translator reads keys before k_norm (`pre_norm`). Mixed into `Session`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from mlx_kvlingo.conversation.records import ROLE, Read, SessionError, Switch
from mlx_kvlingo.conversation.timing import Paths
from mlx_kvlingo.kv.cache import append_kv, new_cache, prefix_copy
from mlx_kvlingo.kv.capture import SpanKV, capture_from_cache, needs_recording, prefill
from mlx_kvlingo.kv.recompute import Selection, recompute_attended, sentence_ends, special_ids
from mlx_kvlingo.kv.translate import append_translation
from mlx_kvlingo.models.pair import LoadedModel

import mlx.core as mx

#: the large model's read of the turn's last tokens may add to the small path's predicted TTFT
#: as much as the plain handoff's own TTFT (where the large reads only the last token), or
#: TAIL_ALLOWANCE_S, whichever is more: a user does not notice a fifth of a second, but does
#: notice an MoE target's seconds-long prefill on the CPU
TAIL_BUDGET = 2.0
TAIL_ALLOWANCE_S = 0.5
#: which translated tokens the large model recomputes: each attention peak with the rest of its
#: sentence, at least 24 tokens, the chat template's markup last (weights/QUALITY.md,
#: "Sentences, not neighbours")
RECOMPUTE_SELECTION = Selection()


class RemoteLarge(Protocol):
    """The large model's cache where it lives on other ranks (the pipelined target,
    distributed/): a session gathers spans from it and places translated spans into it."""

    def gather(self, cache: list, start: int, end: int) -> SpanKV: ...

    def place(self, cache: list, span: SpanKV) -> None: ...


@dataclass
class _Model:
    name: str
    loaded: LoadedModel
    cache: list
    held: int = 0  # the cache holds conversation tokens [0, held)


class CatchUp:
    """Bringing one model's cache up to the conversation (state lives on `Session`)."""

    def _name(self, model: str) -> str:
        try:
            return ROLE[model]
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

    @property
    def recompute_share(self) -> float:
        """When the small model reads for the large one: after the large reads the turn's last
        `large_reads_last` tokens itself, it recomputes this share of the span just translated,
        the tokens its reading attended to most (0: none; `_recompute`)."""
        return self._recompute_share

    @recompute_share.setter
    def recompute_share(self, x: float) -> None:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
            raise SessionError(f"recompute_share must be a number in [0, 1] (got {x!r})")
        self._recompute_share = float(x)

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
                m.cache, m.held = new_cache(m.loaded), 0
            span = self._capture(o, m.held, end, cut)
            span.tokens = tuple(self.tokens[span.start : span.end])
            self._translate_into(m, tr, span)
            m.held = end
            sw.translated = span.length
            sw.seconds = time.perf_counter() - t0
        self.switches.append(sw)
        return sw

    def _reading(self, upto: int) -> tuple[int, bool]:
        """How much the large model reads itself where the small reads for it: (its last
        tokens, whether it recomputes). `large_reads_last` and `recompute_share`, unless that
        is predicted to take more than `TAIL_BUDGET` times the plain handoff's TTFT and
        `TAIL_ALLOWANCE_S` more than it; then without the recompute, then the last token only
        (the plain handoff itself)."""
        k, share = self.policy.large_reads_last, self.policy.recompute_share > 0
        ways = [(k, share), *([(k, False)] if share else []), *([(1, False)] if k > 1 else [])]
        if len(ways) == 1 or self.forward is None or self.mode != "alternation":
            return ways[0]
        a = self._paths_with(upto, 1, False).small(self.read_costs)
        if a is None:
            return ways[0]
        limit = max(TAIL_BUDGET * a, a + TAIL_ALLOWANCE_S)
        for tail, recompute in ways:
            b = self._paths_with(upto, tail, recompute).small(self.read_costs)
            if b is None or b <= limit:
                return tail, recompute
        return 1, False

    def _tail_cut(self, upto: int, paths: Paths | None = None) -> int:
        """Where the small model's reading for the large one stops: the large reads
        conversation[cut : upto + 1] itself, its last `_reading` tokens (fewer where it
        already holds more). `paths`: this turn's, where already predicted (their tail)."""
        if paths is not None:
            return upto + 1 - paths.tail
        held = min(self._models["target"].held, upto)
        return max(held, upto + 1 - self._reading(upto)[0])

    def _paths_with(self, upto: int, tail: int, recompute: bool = True) -> Paths:
        t, s = self._models["target"].held, self._models["source"].held
        th, sh = min(t, upto), min(s, upto)
        cut = max(th, upto + 1 - tail)
        return Paths(upto + 1 - th, max(th - sh, 0), max(cut - max(sh, th), 0),
                     self.backward is not None, upto + 1 - cut,
                     self._recompute_count(cut - th) if recompute else 0)  # fmt: skip

    def _recompute_count(self, translated: int) -> int:
        """How many of `translated` tokens the large model recomputes (`recompute_share`)."""
        if self.mode != "alternation":
            return 0
        return RECOMPUTE_SELECTION.count(self.policy.recompute_share, translated)

    def _recompute(self, m: _Model, sw: Switch, n0: int) -> None:
        """After translating `sw`'s span into the large model (its cache now holds [0, cut)):
        it reads conversation[cut:n0] itself and recomputes the `recompute_share` of the span
        its reading attended to most (`recompute.recompute_attended`). The cache is left
        holding [0, n0 - 1): the answer reads the last token. Interrupted, the cache keeps
        [0, cut) (some of its positions recomputed in some layers: K/V of the target's own
        either way)."""
        cut, toks = m.held, self.tokens[:n0]
        t0 = time.perf_counter()
        try:
            append_kv(m.cache, *_placeholders(m.cache, n0 - cut))
            chosen = recompute_attended(m.loaded.model, m.cache, toks, n0 - cut,
                                        self.policy.recompute_share, start=cut - sw.translated,
                                        selection=RECOMPUTE_SELECTION,
                                        ends=sentence_ends(self.pair.tokenizer),
                                        specials=special_ids(self.pair.tokenizer))  # fmt: skip
            m.held = n0 - 1
        finally:
            self._settle(m, m.held)
        sw.recomputed, sw.tail_read = len(chosen), n0 - cut
        sw.recompute_s = time.perf_counter() - t0

    def _paths(self, upto: int) -> Paths | None:
        """The lengths of the two ways the large model can come to read conversation[:upto + 1]
        (None where no prediction applies: no forward map, or not alternation)."""
        if self.forward is None or self.mode != "alternation":
            return None
        return self._paths_with(upto, *self._reading(upto))

    def _reader_choice(self, name: str, upto: int) -> tuple[bool, str, Paths | None]:
        """Does the small model read [large's held, upto) for `name` this turn (reader policy,
        see session.py)? (yes or no, a note for the status line, the lengths)."""
        if name != "target" or self.forward is None or self.mode == "reprefill":
            return False, "", None  # reprefill is the reference: the answering model reads it all
        paths = self._paths(upto)
        if self._tail_cut(upto, paths) <= self._models["target"].held:  # one way only
            why = (
                f"the turn is within the {self.policy.large_reads_last} tok the large reads itself"
            )
            return False, "" if self.policy.reader == "self" else why, None
        small, why = self._reader_rule(upto, paths)
        over = f"would take over {TAIL_BUDGET:g}x this TTFT and {TAIL_ALLOWANCE_S:g} s more"
        if small and self.policy.large_reads_last > 1 and paths is not None and paths.tail == 1:
            why = (f"the large reads the last token only: reading the last "
                   f"{self.policy.large_reads_last} tok {over}")  # fmt: skip
        elif small and paths is not None and self._recompute_count(paths.lacked - paths.tail) \
                and not paths.recompute:  # fmt: skip
            why = f"no recompute: recomputing {self.policy.recompute_share:.0%} of the turn {over}"
        return small, why, paths

    def _reader_rule(self, upto: int, paths: Paths | None) -> tuple[bool, str]:
        """The reader policy's choice: (the small model reads, why the large reads itself)."""
        if self.policy.reader in ("small", "self"):
            return self.policy.reader == "small", ""
        held = self._models["target"].held
        rule = held == 0 or upto - held >= self.policy.reader_min_tokens
        under = f"the large reads turns under {self.policy.reader_min_tokens} tok"
        if self.policy.reader == "tokens":
            return rule, "" if rule else f"reader tokens: {under}"
        large = None if paths is None else paths.large(self.read_costs)
        small = None if paths is None else paths.small(self.read_costs)
        if large is None or small is None:
            return rule, "" if rule else f"reader auto, not timed yet: {under}"
        if abs(large - small) <= self.policy.reader_margin * min(large, small):
            return rule, "" if rule else f"reader auto, a tie: {under}"
        return small < large, "" if small < large else "reader auto: the faster"

    def _observe(self, stats) -> None:
        """Feed what this turn measured into the pair's read costs (reader "auto")."""
        costs = self.read_costs
        rd, sw = stats.read, stats.switch
        if rd is not None:
            costs.source_read.observe(rd.tokens, rd.seconds)
            c = rd.catch_up
            if c is not None and c.translated and not c.retranslated:
                costs.backward.observe(c.translated, c.seconds)
        if sw is not None and sw.translated and not sw.retranslated:
            (costs.forward if sw.into == "target" else costs.backward).observe(
                sw.translated, sw.seconds
            )
        if stats.model == "target":
            costs.observe_target(stats.prompt_tokens, stats.prompt_s)

    def _read_ahead(self, upto: int, chunk: int) -> Read:
        """The small model catches up on the large's last answer, then reads up to `upto`
        itself (prefill only), `chunk` tokens at a time; a cancel stops it between chunks.

        However it stops (cancel, Ctrl-C), its cache holds exactly what it read.
        """
        m = self._models["source"]
        read = Read("source", catch_up=self._catch_up("source", upto))
        t0 = time.perf_counter()
        try:
            while m.held < upto and not self._cancel.is_set():
                piece = self.tokens[m.held : min(upto, m.held + chunk)]
                m.loaded.model(mx.array(piece)[None], cache=m.cache)
                mx.eval([c.keys for c in m.cache])
                m.held += len(piece)
                read.tokens += len(piece)
        finally:
            self._settle(m, m.held)
            read.seconds = time.perf_counter() - t0
        return read

    def _ahead_begin(self, upto: int) -> Switch | None:
        """Translate ahead (cascade): while the small model answers, the span the large would
        lack on escalation, [large's held, upto), is translated chunk by chunk between the
        small model's tokens (`_ahead_step`). Kept either way: it is a prefix of the
        conversation, so alternation stays exact and no span is translated twice."""
        if not (
            self.policy.translate_ahead and self.forward is not None and self.mode == "alternation"
        ):
            return None
        t = self._models["target"]
        self._settle(t, min(t.held, upto))
        if t.held >= upto:
            return None
        if self._ahead_budget is not None:  # a debt carries over; unspent credit does not
            self._ahead_budget.credit = min(self._ahead_budget.credit, 0.0)
        return Switch("target", self.mode, t.held, t.held, note=f"translated ahead to {upto}")

    def _ahead_step(self, sw: Switch, upto: int, decode_s: float | None) -> float:
        """After one small token (decoded in `decode_s`, None for the first): translate the
        next chunk of the ahead span, as much as the budget allows (or `ahead_chunk` tokens
        without one). Returns the seconds spent."""
        t, o = self._models["target"], self._models["source"]
        a = t.held
        read = min(c.offset for c in o.cache)  # the small model's cache, mid-answer
        remaining = min(upto, read) - a
        budget = self._ahead_budget
        if budget is None:
            n = min(remaining, self.policy.ahead_chunk)
        else:
            if decode_s is not None:
                budget.earn(decode_s)
            n = budget.tokens(remaining)
        if n <= 0:
            return 0.0
        b = a + n
        t0 = time.perf_counter()
        try:
            span = self._capture(o, a, b, self.forward.config.key_cut)
            span.tokens = tuple(self.tokens[a:b])
            self._translate_into(t, self.forward, span)
            t.held = b
        finally:
            self._settle(t, t.held)  # an interrupted append leaves no half-written layer
        seconds = time.perf_counter() - t0
        if budget is not None:
            budget.spent(n, seconds)
        if not sw.translated:
            self.switches.append(sw)
        sw.end = t.held
        sw.translated = sw.end - sw.start
        sw.seconds += seconds
        return seconds

    def _translate_into(self, m: _Model, tr, span: SpanKV) -> None:
        """Append the translated span to m's cache (it holds exactly [0, span.start))."""
        if m.name == "target" and self.remote is not None:
            if tr is not self.forward:
                raise SessionError("a pipelined target translates with the runtime's translator")
            self.remote.place(m.cache, span)
        else:
            append_translation(m.loaded, tr, span, m.cache)

    def _capture(self, o: _Model, start: int, end: int, cut: str) -> SpanKV:
        """The outgoing model's K/V for [start, end) at the translator's key cut."""
        if o.name == "target" and self.remote is not None:
            if needs_recording(o.loaded, cut):
                raise SessionError(
                    "a pre_norm backward translator is not available with a pipelined large "
                    "model (it would recompute the large model's keys); use a post_norm one"
                )
            return self.remote.gather(o.cache, start, end)
        if not needs_recording(o.loaded, cut):
            return capture_from_cache(o.loaded, o.cache, start, end)
        # pre-k_norm keys are not in the cache: recompute the span on the cached prefix
        scratch = prefix_copy(o.cache, start)
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


def _placeholders(cache: list, n: int) -> tuple[list, list]:
    """Zero K/V for `n` positions per layer, overwritten before anything attends to them."""
    keys = [mx.zeros((*c.keys.shape[:2], n, c.keys.shape[-1]), dtype=c.keys.dtype) for c in cache]
    vals = [mx.zeros((*c.values.shape[:2], n, c.values.shape[-1]), dtype=c.values.dtype)
            for c in cache]  # fmt: skip
    return keys, vals
