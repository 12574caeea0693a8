"""One conversation, two models, each with its own cache: the turn loop, top to bottom.

Invariant: the conversation is one list of token ids (`Transcript`: the chat template applied to
its messages); each model's cache holds a prefix of it, `held` tokens long, in every layer
(`ModelCache`). A change returns `keep`, how many old tokens are still the conversation's, and
both caches are cut to it; however a turn stops, the emitted tokens are the answer and the
cache is cut to match. A span is translated at its true positions, once. A turn:

    1. hand-off   who reads it (reader.py, decided once into a `Decision`): the small model, the
                  span the large lacks translated, the large reading the last tokens and
                  recomputing; or the answering model catches up by the mode (alternation: only
                  [held, other's held); naive: all the other holds; reprefill: none) and reads;
    2. decode     mlx-lm's `stream_generate` on the answering model's cache;
    3. commit.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.config import MODES, PolicyError, ReaderPolicy
from mlx_kvlingo.conversation import reader, stream
from mlx_kvlingo.conversation.stream import (
    ContextOverflowError,
    Read,
    SessionError,
    SessionFileError,
    Switch,
    TurnStats,
    role,
)
from mlx_kvlingo.kv.cache import append_zeros, new_cache, prefix_copy, reserve
from mlx_kvlingo.kv.capture import SpanKV, needs_recording, prefill
from mlx_kvlingo.kv.recompute import (
    read_positions,
    recompute_attended,
    sentence_ends,
    special_ids,
)
from mlx_kvlingo.kv.translator import Side, Translator, append_translation
from mlx_kvlingo.models.files import parse_json, read_header
from mlx_kvlingo.models.pair import LoadedModel, ModelPair, model_fingerprint

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def has_template(tokenizer) -> bool:
    has = getattr(tokenizer, "has_chat_template", None)
    return bool(getattr(tokenizer, "chat_template", None)) if has is None else has


def templated(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """The chat template's token ids for `messages` (no template: the contents, a line each)."""
    if has_template(tokenizer):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        return list(out if isinstance(out, list) else out["input_ids"])  # or a BatchEncoding
    out: list[int] = []
    for i, m in enumerate(messages):
        out += tokenizer.encode(m["content"] + "\n", add_special_tokens=i == 0)
    return out


class Transcript:
    """The token list and its messages (a base of `Session`; module docstring), each change
    ending in `_keep`; `user_start`: where an unanswered user message starts, `answer`: the
    (start, model) of the last answer a model gave."""

    def _reset_transcript(self) -> None:
        self.tokens: list[int] = []
        system = [{"role": "system", "content": self.system_prompt}]
        self.messages: list[dict] = system if self.system_prompt else []
        self.user_start: int | None = None
        self.answer: tuple[int, str] | None = None
        self.retemplated = 0  # times a template was not prefix-stable (caches trimmed)

    @property
    def pending(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def cut(self, n: int) -> int:
        self.tokens = self.tokens[:n]
        if self.answer and self.answer[0] >= n:
            self.answer = None
        return n

    def add_user(self, text: str) -> list[int]:
        """Append a user message and the generation prompt (replacing one never answered)."""
        self._claim()
        keep = len(self.tokens)
        if self.pending and self.user_start is not None:  # before reading the tokens it replaces
            keep = self.cut(self.user_start)
            self.messages.pop()
        start, kept = self.append({"role": "user", "content": text}, True)
        self.user_start = start
        self._keep(min(keep, kept))
        return self.tokens[start:]

    def add_assistant(self, text: str) -> list[int]:
        """Append an answer given as text (history from elsewhere; it cannot be escalated)."""
        self._claim()
        if not self.pending:
            raise SessionError("an assistant message must follow a user message")
        start, keep = self.append({"role": "assistant", "content": text}, False)
        self.answer = self.user_start = None
        self._keep(keep)
        return self.tokens[start:]

    def _drop_answer(self) -> str:
        """Remove the last answer a model gave: that model."""
        if self.answer is None or not self.messages or self.messages[-1]["role"] != "assistant":
            raise SessionError("nothing to escalate: there is no answer yet")
        start, answered = self.answer
        self.cut(start)
        self.messages.pop()
        self.answer = self.user_start = None
        self._keep(start)
        return answered

    def _add_answer(self, n0: int, emitted: list[int], text: str, model: str) -> None:
        self.tokens = self.tokens[:n0] + list(emitted)
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.answer is not None:
            last["content"] += text  # a continuation of the last answer
        else:
            self.messages.append({"role": "assistant", "content": text})
            self.answer = (n0, model)
        self.user_start = None

    def answers(self) -> list[int]:
        tok = self.tokenizer
        return [t for msg in self.messages if msg["role"] == "assistant" and msg["content"]
                for t in tok.encode(msg["content"], add_special_tokens=False)]  # fmt: skip

    def append(self, message: dict, generation_prompt: bool) -> tuple[int, int]:
        """Append `message` as the tokens the template adds: (where they start, keep). The
        templated tokens extend the conversation's, else the templated text its text (after an
        answer: anchored on the answer's text, whose re-tokenization may differ from the tokens
        generated) and only the new text is encoded, else all is re-tokenized."""
        messages = self.messages + [message]
        full = templated(self.tokenizer, messages, generation_prompt)
        n = keep = len(self.tokens)
        if full[:n] == self.tokens:
            self.tokens, start = full, n
        elif (new := self._text_diff(messages, generation_prompt)) is not None:
            self.tokens, start = self.tokens + new, n
        else:
            gp = message["role"] == "assistant"
            before = templated(self.tokenizer, self.messages, gp) if self.messages else []
            keep = self.cut(common_prefix(self.tokens, full))
            start = len(before) if full[: len(before)] == before else keep
            self.tokens = full
            self.retemplated += 1
        self.messages.append(message)
        return start, keep

    def _text_diff(self, messages: list[dict], gp: bool) -> list[int] | None:
        tok = self.tokenizer
        if not has_template(tok):
            return None
        text = tok.apply_chat_template(messages, add_generation_prompt=gp, tokenize=False)
        last = self.messages[-1] if self.messages else None
        if self.answer is not None and last and last["role"] == "assistant" and last["content"]:
            prev = tok.apply_chat_template(self.messages, tokenize=False)
            pos = prev.rfind(last["content"])
            if pos >= 0 and text.startswith(head := prev[: pos + len(last["content"])]):
                tail = text[len(head) :]
                if self.tokens and self.tokens[-1] in tok.eos_token_ids:
                    tail = tail.removeprefix(tok.decode([self.tokens[-1]]))
                return list(tok.encode(tail, add_special_tokens=False)) if tail else []
        done = tok.decode(self.tokens)
        if text.startswith(done) and len(text) > len(done):
            return list(tok.encode(text[len(done) :], add_special_tokens=False))
        return None

    def trim(self, max_tokens: int | None = None) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` (default: half of
        `max_kv_size`), the system prompt and the last message kept; the messages dropped."""
        if max_tokens is None:
            if self.max_kv_size is None:
                raise SessionError("trim needs a token budget (or a session max_kv_size)")
            max_tokens = self.max_kv_size // 2
        self._claim()
        head = [m for m in self.messages[:1] if m["role"] == "system"]
        rest = self.messages[len(head) :]
        gp = bool(rest) and rest[-1]["role"] == "user"
        while len(rest) > 1 and len(templated(self.tokenizer, head + rest, gp)) > max_tokens:
            rest = rest[1:]
            while len(rest) > 1 and rest[0]["role"] != "user":  # start on a user turn
                rest = rest[1:]
        dropped = len(self.messages) - len(head) - len(rest)
        if not dropped:
            return 0
        full = templated(self.tokenizer, head + rest, gp)
        if len(full) > max_tokens:
            raise ContextOverflowError(
                f"even the last message alone is {len(full)} tokens, over the {max_tokens} budget"
            )
        keep = self.cut(common_prefix(self.tokens, full))
        self.tokens, self.messages = full, head + rest
        self.answer = self.user_start = None
        if gp:  # the kept last message awaits its answer
            before = templated(self.tokenizer, head + rest[:-1], False) if head or rest[:-1] else []
            if full[: len(before)] == before:
                self.user_start = len(before)
        self._keep(keep)
        return dropped


READ_CHUNK = 512  # tokens a turn is read, captured and translated at a time
SCORES_BYTES = 64 << 20  # one read chunk's float32 attention scores, at most (`small_reads`)


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
        """Every layer holds the first tokens all layers hold, at most `want` (an interrupted
        read may leave some layers ahead)."""
        keep = min([want] + [c.offset for c in self.cache])
        for c in self.cache:
            if c.offset > keep:
                c.trim(c.offset - keep)
        self.held = keep


class CatchUp:
    """The session's catching up (a base of `Session`, whose state it acts on)."""

    def _hand_off(self, name: str, n0: int, stats: TurnStats, chunk: int,
                  progress: Progress | None = None) -> reader.Paths | None:  # fmt: skip
        """Step 1 for `name` about to answer conversation[:n0], as `reader.choose` decides;
        fills `stats`, returns the predicted paths."""
        d = reader.choose(self, name, n0 - 1)
        stats.read_note, stats.retention, paths = d.note, d.retention, d.paths
        if paths is not None:  # what was predicted for the path taken
            stats.predicted_ttft_s = (paths.small if d.small else paths.large)(self.read_costs)
        m = self.models[name]
        reserve(m.loaded, m.cache, n0 + 1)  # no cache grows (2x its size) while it is read
        upto = n0 - 1  # the answering model reads at least the last token itself
        if d.small:  # the large still reads the turn's last tokens itself (from d.cut)
            upto = d.cut
            stats.read = self.small_reads(upto, chunk, progress)
            if self.cancelled.is_set():  # stopped while the small model read
                stats.finish_reason = "cancelled"
                return paths
        stats.switch = sw = self.catch_up(name, upto)
        if d.recompute and sw is not None and sw.translated:  # the tail, then the recompute
            self.recompute(sw, n0)
            if self.cancelled.is_set():
                stats.finish_reason = "cancelled"
        return paths

    def catch_up(self, name: str, upto: int) -> Switch | None:
        """Bring model `name` to hold conversation[:a], a <= upto, by the mode; the `Switch`
        where the other model held tokens this one lacked."""
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
        """Append the translation of o's K/V for [start, end) to m (holding [0, start)),
        `READ_CHUNK` tokens at a time where it can; m holds whole chunks however it stops."""
        cut = tr.config.key_cut
        whole = self.remote is not None or needs_recording(o.loaded, cut)
        chunk = end - start if whole else READ_CHUNK
        try:
            for s in range(start, end, chunk):
                e = min(end, s + chunk)
                span = self.capture(o, tr, s, e)
                span.tokens = tuple(self.tokens[s:e])
                if m.name == "target" and self.remote is not None:
                    self.remote.place(m.cache, span)
                else:
                    append_translation(m.loaded, tr, span, m.cache)
                m.held = e
        finally:
            m.settle(m.held)  # an interrupted append leaves no half-written layer

    def capture(self, o: ModelCache, tr: Translator, start: int, end: int) -> SpanKV:
        """o's RoPE-free K/V for [start, end) at `tr`'s key cut (the layers `tr` reads)."""
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
        return prefill(o.loaded, self.tokens[start:end], prefix_copy(o.cache, start),
                       cut=cut)  # fmt: skip

    def small_reads(self, upto: int, chunk: int, progress=None) -> Read:
        """The small model catches up on the large's last answer, then reads up to `upto` by
        chunks of n <= `chunk` tokens, n x (held + chunk) x heads x 4 <= `SCORES_BYTES` (n >=
        chunk // 8), a cancel stopping it between two; its cache holds exactly what it read.
        `progress`: before and after each chunk."""
        m = self.models["source"]
        read = Read("source", catch_up=self.catch_up("source", upto), start=m.held)
        reserve(m.loaded, m.cache, upto)  # no layer grows (2x its size) while it reads
        t0, total = time.perf_counter(), max(upto - m.held, 0)
        progress = progress or (lambda *_: None)
        try:
            while m.held < upto and not self.cancelled.is_set():
                progress("source", read.tokens, total)
                most = SCORES_BYTES // (4 * m.loaded.query_heads * (m.held + chunk))
                n = max(chunk // 8, min(chunk, most))
                piece = self.tokens[m.held : min(upto, m.held + n)]
                m.loaded.model(mx.array(piece)[None], cache=m.cache)
                mx.eval([c.keys for c in m.cache])
                m.held += len(piece)
                read.tokens += len(piece)
            if total:
                progress("source", read.tokens, total)
        finally:
            m.settle(m.held)
            read.seconds = time.perf_counter() - t0
        return read

    def recompute(self, sw: Switch, n0: int) -> None:
        """After `sw`'s span is translated into the large model (holding [0, cut)): it reads
        conversation[cut:n0] and recomputes the `recompute_share` of the span that reading
        attended to most, leaving [0, n0 - 1) (interrupted: [0, cut))."""
        m = self.models["target"]
        cut, toks, tok = m.held, self.tokens[:n0], self.pair.tokenizer
        t0, ends, specials = time.perf_counter(), sentence_ends(tok), special_ids(tok)
        votes = self._small_votes(toks, cut) if reader.RECOMPUTE_SELECTION.votes else None
        try:
            append_zeros(m.cache, n0 - cut)
            chosen = recompute_attended(m.loaded.model, m.cache, toks, n0 - cut,
                                        self.policy.recompute_share, start=cut - sw.translated,
                                        selection=reader.RECOMPUTE_SELECTION, ends=ends,
                                        specials=specials, votes=votes)  # fmt: skip
            m.held = n0 - 1
        finally:
            m.settle(m.held)
        sw.recomputed, sw.tail_read = len(chosen), n0 - cut
        sw.recompute_s = time.perf_counter() - t0

    def _small_votes(self, toks: list[int], cut: int) -> mx.array:
        """The small model reads toks[cut:] over the cache it holds [0, cut) of and returns the
        attention its reading put on each position (`read_positions`): it then holds toks.
        Interrupted, it keeps [0, cut)."""
        s = self.models["source"]
        s.settle(cut)
        try:
            append_zeros(s.cache, len(toks) - cut)
            votes = read_positions(s.loaded.model, s.cache, toks, range(cut, len(toks)), True)
            s.held = len(toks)
        finally:
            s.settle(s.held)
        return votes


class Session(CatchUp, Transcript):
    """One conversation over a model pair: the source (small) and target (large) model;
    `forward` translates source K/V into the target's cache, `backward` the other way (without
    it, handing the conversation back to the source re-prefills)."""

    def __init__(self, pair: ModelPair, forward: Translator | None,
                 backward: Translator | None = None, mode: str = "alternation", *,
                 system_prompt: str | None = None, max_kv_size: int | None = None,
                 policy: ReaderPolicy | None = None, read_costs: reader.ReadCosts | None = None,
                 remote=None, retention: reader.Retention | None = None):  # fmt: skip
        src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
        for label, tr, a, b in (("forward", forward, src, tgt), ("backward", backward, tgt, src)):
            if tr is not None and (tr.config.source, tr.config.target) != (a, b):
                raise SessionError(
                    f"the {label} translator maps {tr.config.source} -> {tr.config.target}, "
                    f"but this direction needs {a} -> {b}"
                )
        self.pair, self.forward, self.backward = pair, forward, backward
        self.remote = remote  # the large model's cache on other ranks: gather, place (distributed/)
        self.max_kv_size = max_kv_size  # the conversation's token limit (None: none)
        self.tokenizer, self.system_prompt = pair.tokenizer, system_prompt
        self._reset_transcript()
        self.models = {n: ModelCache(n, getattr(pair, n), new_cache(getattr(pair, n)))
                       for n in ("source", "target")}  # fmt: skip
        self.turns: list[TurnStats] = []
        self.switches: list = []  # every `Switch`, in order
        self.cancelled = threading.Event()  # set by `cancel()`: the turn stops after a token
        self._active: Responses | None = None  # the generation left open
        self.mode, self.policy = mode, ReaderPolicy() if policy is None else policy
        self.read_costs = reader.costs_of(pair) if read_costs is None else read_costs  # reader auto
        self.retention = retention  # what the small path keeps by length (None: not measured)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise SessionError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        self._mode = mode

    @property
    def policy(self) -> ReaderPolicy:
        """Who reads a turn and what the large model recomputes (config.py); its reader resolved:
        "auto" with a forward translator, else "self"."""
        return self._policy

    @policy.setter
    def policy(self, policy: ReaderPolicy) -> None:
        if not isinstance(policy, ReaderPolicy):
            raise SessionError(f"policy must be a ReaderPolicy (got {type(policy).__name__})")
        if self.remote is not None and policy.recompute_share:  # all layers, in this process
            raise SessionError(
                "the recompute (recompute_share > 0) is not available with a pipelined large model"
            )
        who = policy.reader or ("auto" if self.forward else "self")
        if who != "self" and self.forward is None:
            raise SessionError(f"reader {who!r} needs a forward (small -> large) translator")
        self._policy = replace(policy, reader=who)

    @property
    def last_turn(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def held(self, model: str) -> int:
        return self.models[role(model)].held

    def cache(self, model: str) -> list:
        """The mlx-lm cache of `model` (holds `held(model)` tokens); read only."""
        return self.models[role(model)].cache

    def cancel(self) -> None:
        """Ask the running generation to stop after its current token (any thread)."""
        self.cancelled.set()

    def stats(self) -> dict:
        """The mode, the policy and the totals per model; `estimated_saving_ms`: over the large
        model's answers the small one read for, its predicted own TTFT less the TTFT."""
        turns, per = self.turns, {}
        for name, m in self.models.items():
            mine = [t for t in turns if t.model == name]
            sw = [x for x in self.switches if x.into == name]
            reads = [t.read for t in turns if t.read is not None and t.read.model == name]
            per[name] = {
                "turns": len(mine),
                "generated_tokens": sum(t.generation_tokens for t in mine),
                "prompt_tokens": sum(t.prompt_tokens for t in mine),
                "prompt_ms": 1e3 * sum(t.prompt_s for t in mine),
                "read_for_other_tokens": sum(r.tokens for r in reads),
                "read_for_other_ms": 1e3 * sum(r.seconds for r in reads),
                "switches_into": len(sw),
                "translated_into": sum(x.translated for x in sw),
                "retranslated_into": sum(x.retranslated for x in sw),
                "translate_ms": 1e3 * sum(x.seconds for x in sw if x.translated),
                "held": m.held,
            }
        saved = sum(t.alternative_ttft_s - t.ttft_s for t in turns if t.read is not None
                    and t.alternative_ttft_s is not None and t.ttft_s is not None)  # fmt: skip
        return {"mode": self.mode, **self.policy.to_dict(),
                "conversation_tokens": len(self.tokens), "messages": len(self.messages),
                "switches": len(self.switches), "retemplated": self.retemplated,
                "estimated_saving_ms": 1e3 * saved, "models": per}  # fmt: skip

    def _keep(self, keep: int) -> None:
        """Both caches cut to the first `keep` tokens (those still the conversation's)."""
        for m in self.models.values():
            m.settle(min(m.held, keep))

    def add_tokens(self, tokens) -> None:
        """Append raw token ids to the conversation (no template; for tests and tools)."""
        self._claim()
        self.tokens.extend(int(t) for t in tokens)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self._claim()
        self._reset_transcript()
        for m in self.models.values():
            m.clear()
        self.turns.clear()
        self.switches.clear()

    def _claim(self) -> None:
        """Close the generation left unfinished (it commits what it emitted). Not thread-safe:
        the pair's lock (stream.py) is."""
        gen, self._active = self._active, None
        if gen is not None:
            gen.close()

    def _begin(self, model: str) -> tuple[str, int | None]:
        """Checks before any work: (the model's role, tokens the turn may add, None: no limit)."""
        name = role(model)
        self._claim()
        n = len(self.tokens)
        if not n:
            raise SessionError("nothing to answer yet: add a user message first")
        for tr, outgoing in ((self.forward, self.pair.source), (self.backward, self.pair.target)):
            if self.mode == "naive" and tr and needs_recording(outgoing, tr.config.key_cut):
                raise SessionError(
                    "naive mode needs post_norm translators (with a pre_norm one the outgoing "
                    "model would recompute its keys, hiding the re-translation drift)"
                )
        over = [
            f"the {label} model ({m.name}) handles at most {m.context_length}"
            for label, m in (("small", self.pair.source), ("large", self.pair.target))
            if m.context_length is not None and n > m.context_length
        ]
        if self.max_kv_size is not None and self.max_kv_size - n < 1:
            over.append(f"the {name} model's context limit is {self.max_kv_size} (max_kv_size)")
        if over:
            raise ContextOverflowError(
                f"the conversation is {n} tokens; {over[0]}: shorten the message, drop the "
                "oldest turns with /trim (Session.trim) or start over with /reset"
            )
        self.cancelled.clear()
        return name, None if self.max_kv_size is None else self.max_kv_size - n

    def generate(self, model: str = "target", *, max_tokens: int = 256, sampler=None,
                 logits_processors=None, prefill_step_size: int = READ_CHUNK,
                 progress: Progress | None = None) -> Responses:  # fmt: skip
        """Stream an answer from `model`. Stopped early, the tokens emitted are the answer;
        stopped while a model reads the turn, each cache keeps the chunks it read whole and the
        turn stays unanswered. `progress(reader, done, total)` is called as the turn is read."""
        name, left = self._begin(model)
        limit = max_tokens
        if left is not None and (max_tokens < 0 or max_tokens > left):  # -1: no limit
            limit = left
        kwargs = dict(sampler=sampler, logits_processors=logits_processors,
                      prefill_step_size=prefill_step_size)  # fmt: skip
        if progress is not None:  # mlx-lm's prefill reports each chunk the answering model reads
            kwargs["prompt_progress_callback"] = lambda done, total: progress(name, done, total)
        self._active = self._generate(name, limit, limit != max_tokens, kwargs, progress)
        return self._active

    def _generate(self, name: str, limit: int, capped: bool, kwargs,
                  progress: Progress | None = None) -> Responses:  # fmt: skip
        """The turn: hand off, decode (at most `limit` tokens; `capped`: the context's limit,
        so "length" ends as "context"), commit."""
        m, t0, n0 = self.models[name], time.perf_counter(), len(self.tokens)
        stats, emitted, steps = TurnStats(name, self.mode), [], None
        try:
            paths = self._hand_off(name, n0, stats, kwargs["prefill_step_size"], progress)
            if stats.finish_reason == "cancelled":
                return
            prompt = self.tokens[m.held : n0]
            stats.prompt_tokens = len(prompt)
            if kwargs.get("logits_processors"):  # they see the earlier answers and this one
                procs = stream.over_answers(kwargs["logits_processors"], self.answers())
                kwargs = {**kwargs, "logits_processors": procs}
            steps = stream_generate(m.loaded.model, self.pair.tokenizer, mx.array(prompt),
                                    max_tokens=limit, prompt_cache=m.cache, **kwargs)  # fmt: skip
            for r in steps:
                emitted.append(r.token)
                stats.text += r.text
                stats.logprobs.append(r.logprobs[r.token].item())
                stats.generation_tokens, stats.prompt_tps = r.generation_tokens, r.prompt_tps
                stats.generation_tps, stats.peak_memory_gb = r.generation_tps, r.peak_memory
                stats.prompt_s = len(prompt) / r.prompt_tps if r.prompt_tps else 0.0
                if len(emitted) == 1:
                    stats.ttft_s = time.perf_counter() - t0
                    reader.observe(self, stats, n0 - len(prompt))
                end = r.finish_reason or ("cancelled" if self.cancelled.is_set() else None)
                if end is not None:
                    stats.finish_reason = "context" if capped and end == "length" else end
                r.finish_reason, last = stats.finish_reason, stats if end else None
                yield stream.GenerationResponse(**vars(r), model=stream.LABEL[name], handoff=last)
                if end is not None:
                    break
        finally:
            if steps is not None:
                steps.close()
            stats.finish_reason = stats.finish_reason or "interrupted"  # however it stopped
            if emitted:
                self._add_answer(n0, emitted, stats.text, m.name)
            m.settle(len(self.tokens))
            self.turns.append(stats)
        if emitted and paths is not None:  # the other path's TTFT, predicted with this turn's rates
            reader.alternative(self, stats, paths, self.tokens[:n0])

    def hand_off(self, model: str = "target") -> TurnStats:
        """`generate`'s hand-off without the answer; its record."""
        name, _ = self._begin(model)
        stats = TurnStats(name, self.mode)
        self._hand_off(name, len(self.tokens), stats, READ_CHUNK)
        return stats

    def escalate(self, model: str | None = None, **generate_kwargs) -> Responses:
        """Answer the last user message again with `model`, else the other model than the one
        that answered it (its answer dropped); one still unanswered is answered as it is."""
        self._claim()
        if not self.pending:
            if model:
                role(model)  # an unknown name is refused before the answer is dropped
            answered = self._drop_answer()
        elif model is None and self.last_turn is None:
            raise SessionError("the last message has no answer yet: name the model to answer")
        else:
            answered = getattr(self.last_turn, "model", None)
        other = "target" if answered == "source" else "source"
        return self.generate(model or other, **generate_kwargs)

    # Session files. Invariant: a file loads only into the pair that wrote it (geometry and a
    # weight fingerprint per model), and a load that fails leaves the session as it was, with a
    # one-line `SessionFileError`. The file is an mlx-lm prompt cache (the source's layers, then
    # the target's), its metadata `kvlingo_session` the rest as JSON; a `.safetensors` suffix is
    # added where missing.

    def save(self, path: str | Path) -> Path:
        self._claim()
        _local(self, "saving")
        pair, models = self.pair, self.models
        path = Path(path)
        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        state = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **_identity(pair),
                 "layers": [pair.source.geometry.layers, pair.target.geometry.layers],
                 "held": {n: models[n].held for n in MODELS}, "tokens": self.tokens,
                 "messages": self.messages, "system_prompt": self.system_prompt,
                 "mode": self.mode, "policy": self.policy.to_dict(),
                 "answer": list(self.answer) if self.answer else None,
                 "user_start": self.user_start, "switches": [asdict(x) for x in self.switches],
                 "turns": [{**asdict(x), "logprobs": []} for x in self.turns]}  # fmt: skip
        caches = [c for n in MODELS for c in prefix_copy(models[n].cache, models[n].held)]
        meta = {"kvlingo_session": json.dumps(state), "model": pair.target.name}
        with atomic_write(path) as tmp:
            save_prompt_cache(str(tmp), caches, meta)
        return path

    def load(self, path: str | Path) -> None:
        self._claim()
        _local(self, "loading")
        path = Path(path)
        if not path.is_file() and path.with_name(path.name + ".safetensors").is_file():
            path = path.with_name(path.name + ".safetensors")
        read_header(path, SessionFileError, "session")  # there and well formed, before mlx reads it
        try:
            caches, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
            raise SessionFileError(f"{path}: not a readable prompt cache file ({e})") from None
        raw = meta.get("kvlingo_session") if isinstance(meta, dict) else None
        if raw is None:
            raise SessionFileError(
                f"{path}: an mlx-lm prompt cache without kvlingo session state "
                "(write session files with /save or Session.save)"
            )
        state = parse_json(raw, f"{path}: the kvlingo_session metadata", SessionFileError)
        if (state.get("schema"), state.get("schema_version")) != (SCHEMA, SCHEMA_VERSION):
            raise SessionFileError(
                f"{path}: unsupported session schema {state.get('schema')!r:.80} "
                f"v{state.get('schema_version')!r:.40}"
            )
        try:
            policy = _restore(path, self, caches, state)
        except SessionFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            what = f"missing {e}" if isinstance(e, KeyError) else str(e)[:300]
            raise SessionFileError(f"{path}: inconsistent session state: {what}") from None
        self.policy = policy


#: progress(reader, done, total): `reader` has read `done` of the turn's `total` tokens it reads
Progress = Callable[[str, int, int], None]
Responses = Iterator[stream.GenerationResponse]
MODELS = ("source", "target")
SCHEMA, SCHEMA_VERSION = "mlx-kvlingo/session", 1


def _local(s, what: str) -> None:
    if s.remote is not None:  # the large model's cache is spread over the ranks
        raise SessionError(f"{what} is not available when the large model is pipelined over ranks")


def _identity(pair: ModelPair) -> dict:
    def side(m) -> dict:
        return dict(name=m.name, geometry=m.geometry.as_dict(), fingerprint=model_fingerprint(m))

    return {n: side(getattr(pair, n)) for n in MODELS} | {"tokenizer": pair.tokenizer_fingerprint}


def _restore(path: Path, s, caches: list, state: dict) -> ReaderPolicy:
    pair = s.pair

    def need(ok, what: str) -> None:
        if not ok:
            raise SessionFileError(f"{path}: {what}")

    mine = _identity(pair)
    for side in MODELS:
        theirs, ours = state[side], mine[side]
        src, tgt = (str(state[n].get("name"))[:200] for n in MODELS)
        need(all(theirs[k] == ours[k] for k in ("geometry", "fingerprint")),
             f"saved with {side} model {str(theirs.get('name'))[:200]} ({src} -> {tgt}); this "
             f"session's {side} is {ours['name']}: a session file only loads into the pair that "
             "wrote it")  # fmt: skip
    need(not state.get("tokenizer") or state["tokenizer"] == mine["tokenizer"],
         "saved with a different tokenizer")  # fmt: skip
    tokens, messages = state["tokens"], state["messages"]
    vocab = min(int(m.model.model.embed_tokens.weight.shape[0]) for m in (pair.source, pair.target))
    need(isinstance(tokens, list) and all(_is_int(t) and 0 <= t < vocab for t in tokens),
         f"tokens must be a list of token ids below {vocab}")  # fmt: skip
    need(isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
         and isinstance(m.get("content"), str) for m in messages),
         "messages must be role/content objects")  # fmt: skip
    need(messages or not tokens, f"{len(tokens)} tokens but no messages: inconsistent")
    ls, lt = pair.source.geometry.layers, pair.target.geometry.layers
    need(state["layers"] == [ls, lt] and len(caches) == ls + lt, f"holds {len(caches)} cache "
         f"layers (says {str(state['layers'])[:40]}), expected {ls} + {lt}")  # fmt: skip
    restored = {}
    for name, part in (("source", caches[:ls]), ("target", caches[ls:])):
        n = state["held"][name]
        need(_is_int(n) and 0 <= n <= len(tokens),
             f"{name} holds {str(n)[:40]} of {len(tokens)} tokens")  # fmt: skip
        _check_cache(need, name, getattr(pair, name).geometry, part, n)
        restored[name] = (part, n)
    answer, user_start, system = (state.get(k) for k in ("answer", "user_start", "system_prompt"))
    need(answer is None or (isinstance(answer, list) and len(answer) == 2 and _is_int(answer[0])
         and 0 <= answer[0] <= len(tokens) and answer[1] in MODELS),
         "answer must be [start token, model]")  # fmt: skip
    need(user_start is None or (_is_int(user_start) and 0 <= user_start <= len(tokens)),
         "user_start must be a token position")  # fmt: skip
    need(system is None or isinstance(system, str), "system_prompt must be a string")
    saved = state.get("policy")  # a setting it lacks keeps the session's own
    need("policy" in state, "an old session file (reader settings flat): start a new conversation")
    need(isinstance(saved, dict), "policy must be an object")
    try:
        policy = ReaderPolicy.from_dict(saved, s.policy)  # names and values checked
    except (PolicyError, TypeError) as e:
        raise SessionFileError(f"{path}: {e}") from None
    if policy.reader != "self" and s.forward is None:
        policy = replace(policy, reader="self")  # saved with a translator this pair lacks
    saved_turns = [_record(TurnStats, t) for t in state.get("turns", [])]
    s.switches[:] = [_record(Switch, x) for x in state.get("switches", [])]  # last that may fail
    s.turns[:] = saved_turns
    s.tokens, s.messages = list(tokens), [dict(m) for m in messages]
    s.system_prompt, s.user_start = system, user_start
    s.answer = tuple(answer) if answer else None
    for name, (part, n) in restored.items():
        s.models[name].cache, s.models[name].held = part, n
    return policy


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_cache(need, name: str, g, cache: list, held: int) -> None:
    """Each layer a plain KVCache holding exactly `held` tokens in geometry `g`."""
    for i, c in enumerate(cache):
        need(type(c) is KVCache, f"{name} layer {i} is a {type(c).__name__}, not a KVCache")
        need(c.offset == held, f"{name} cache disagrees with its sync state")
        kv = (("keys", c.keys, g.head_dim), ("values", c.values, g.value_dim)) if held else ()
        for what, a, dim in kv:
            want = (1, g.kv_heads, held, dim)
            shape = tuple(a.shape) if isinstance(a, mx.array) else type(a).__name__
            need(shape == want, f"{name} layer {i} {what} are {shape}, expected {want}")
            need(mx.issubdtype(a.dtype, mx.floating), f"{name} layer {i} {what} are {a.dtype}")


NESTED = {"switch": Switch, "read": Read, "catch_up": Switch}
#: fields a turn had that are gone: read, dropped (0.2.0's `alternative_ttft_s`; translate-ahead)
DROPPED = ("alone_prefill_s", "ahead")


def _record(kind: type, d: dict | None):
    """A saved record and those in it, its `DROPPED` fields dropped."""
    items = [(k, v) for k, v in (d or {}).items() if k not in DROPPED]
    out = {k: _record(NESTED[k], v) if k in NESTED else v for k, v in items}
    return None if d is None else kind(**out)
