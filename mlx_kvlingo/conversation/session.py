"""One conversation, two models, each with its own cache: the turn loop, top to bottom.

Invariant: the conversation is one list of token ids (`Transcript`); each model's mlx-lm cache
holds a prefix of it, `held` tokens long, in every layer (`ModelCache`). Every change to the
conversation cuts both caches to the prefix they still share with it, and a turn always ends in
`_commit`, however it stops (end, max tokens, `cancel()`, Ctrl-C, the iterator closed or
collected): the emitted tokens become the answer and the cache is cut to match. No span is
translated twice.

A turn (`generate`):

    1. hand-off (`_hand_off`)   who reads the turn (reader.py, decided once into a `Decision`):
                                the small model reads it, the span the large lacks is translated,
                                the large reads the last tokens and recomputes (catchup.py); or
                                the answering model catches up by the mode and reads the rest;
    2. decode (`stream.decode`) mlx-lm's `stream_generate` on the answering model's own cache,
                                reading at least the last conversation token itself; each token
                                is in the answer and the `TurnStats` before it is yielded;
    3. commit (`_commit`)       the emitted tokens become the answer, the cache is cut to match.

A turn over n conversation tokens may add at most `max_kv_size - n` (no limit without it), and a
conversation past either model's context is refused before any work. The modes (`MODES`), how a
model catches up: catchup.py. Nothing here prints: `generate` yields mlx-lm-shaped
`GenerationResponse`s (the last carries the turn's `TurnStats` as `handoff`), and every turn
leaves its `TurnStats` in `Session.turns`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mlx_kvlingo.config import MODES, ReaderPolicy
from mlx_kvlingo.conversation import persistence, reader, stream
from mlx_kvlingo.conversation.catchup import (
    READ_CHUNK,
    CatchUp,
    ModelCache,
    RemoteLarge,
    check_directions,
    check_mode,
)
from mlx_kvlingo.conversation.reader import Paths, ReadCosts, Retention, costs_of
from mlx_kvlingo.conversation.transcript import (
    ContextOverflowError,
    GenerationResponse,
    SessionError,
    Transcript,
    TurnStats,
    role,
    totals,
)
from mlx_kvlingo.kv.cache import new_cache, reserve
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair


def _kept(name: str, doc: str) -> property:
    """An attribute the transcript keeps, read and set through the session."""
    return property(lambda self: getattr(self.transcript, name),
                    lambda self, v: setattr(self.transcript, name, v), doc=doc)  # fmt: skip


class Session(CatchUp):
    """One conversation over a model pair: the source (small) and target (large) model.

    `forward` translates source K/V into the target's cache, `backward` the other way; without
    `backward`, handing the conversation back to the source re-prefills (the switch's `note`).

        s = Session(pair, forward, backward)
        s.add_user("Hello")
        for ev in s.generate("source"):
            print(ev.text, end="")
        s.add_user("Tell me more")
        for ev in s.generate("target"):   # translates only what the target lacks
            ...
    """

    def __init__(self, pair: ModelPair, forward: Translator | None,
                 backward: Translator | None = None, mode: str = "alternation", *,
                 system_prompt: str | None = None, max_kv_size: int | None = None,
                 policy: ReaderPolicy | None = None, read_costs: ReadCosts | None = None,
                 remote: RemoteLarge | None = None, retention: Retention | None = None):  # fmt: skip
        check_directions(pair, forward, backward)
        self.pair, self.forward, self.backward = pair, forward, backward
        self.remote = remote  # the large model's cache on other ranks (distributed/), if any
        self.max_kv_size = max_kv_size  # the conversation's token limit (None: none)
        self.transcript = Transcript(pair.tokenizer, system_prompt)
        self.models = {n: ModelCache(n, getattr(pair, n), new_cache(getattr(pair, n)))
                       for n in ("source", "target")}  # fmt: skip
        self.turns: list[TurnStats] = []
        self.switches: list = []  # every `Switch`, in order
        self.cancelled = threading.Event()  # set by `cancel()`: the turn stops after a token
        self._active: Responses | None = None  # the generation left open
        self.mode, self.policy = mode, ReaderPolicy() if policy is None else policy
        self.read_costs = costs_of(pair) if read_costs is None else read_costs  # reader auto
        self.retention = retention  # what the small path keeps by length (None: not measured)

    tokens = _kept("tokens", "the conversation's token ids")
    messages = _kept("messages", "the role/content dicts of the conversation")
    system_prompt = _kept("system_prompt", "the system message (reset keeps it)")
    retemplated = _kept("retemplated", "times a template was not prefix-stable")
    pending = _kept("pending", "the last message is a user's, not answered yet")

    @property
    def mode(self) -> str:
        """alternation, naive or reprefill: how a model catches up (catchup.py)."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise SessionError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        self._mode = mode

    @property
    def policy(self) -> ReaderPolicy:
        """Who reads a turn and what the large model recomputes (config.py), as
        `reader.resolve_policy` resolves it; change it with dataclasses.replace."""
        return self._policy

    @policy.setter
    def policy(self, policy: ReaderPolicy) -> None:
        self._policy = reader.resolve_policy(self, policy)
        self.ahead_credit = 0.0  # seconds of translating ahead the small model's tokens earned

    @property
    def last_turn(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def held(self, model: str) -> int:
        """How many conversation tokens `model`'s cache holds."""
        return self.models[role(model)].held

    def cache(self, model: str) -> list:
        """The mlx-lm cache of `model` (holds `held(model)` tokens). Do not modify it."""
        return self.models[role(model)].cache

    def cancel(self) -> None:
        """Ask the running generation to stop after its current token (any thread)."""
        self.cancelled.set()

    def stats(self) -> dict:
        """The mode, the policy and the conversation's totals (`transcript.totals`)."""
        totaled = totals(self.transcript, self.turns, self.switches, self.models)
        return {"mode": self.mode, **self.policy.to_dict(), **totaled}

    # -- changes between turns: the transcript changes, both caches are cut to match ----------

    def _change(self, change: Callable, *args) -> int:
        """`change(*args)` returns (its result, keep): both caches keep at most `keep` tokens."""
        self._claim()
        out, keep = change(*args)
        for m in self.models.values():
            m.settle(min(m.held, keep))
        return out

    def add_user(self, text: str) -> list[int]:
        """Append a user message (and the template's generation prompt); return its tokens. An
        earlier user message that never got an answer (stopped before its first token) is
        replaced."""
        start = self._change(self.transcript.add_user, text)
        return self.tokens[start:]

    def add_assistant(self, text: str) -> list[int]:
        """Append an answer given as text (history from elsewhere); return its tokens. Whichever
        model answers next catches up on it; it cannot be escalated (no model produced it)."""
        start = self._change(self.transcript.add_assistant, text)
        return self.tokens[start:]

    def add_tokens(self, tokens) -> None:
        """Append raw token ids to the conversation (no template; for tests and tools)."""
        self._claim()
        self.tokens.extend(int(t) for t in tokens)

    def trim(self, max_tokens: int | None = None) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens (default:
        half of `max_kv_size`); the system prompt and the last message stay, and the next
        answering model re-reads what moved. Returns the number of messages dropped."""
        if max_tokens is None:
            if self.max_kv_size is None:
                raise SessionError("trim needs a token budget (or a session max_kv_size)")
            max_tokens = self.max_kv_size // 2
        return self._change(self.transcript.trim, max_tokens)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self._claim()
        self.transcript.reset()
        for m in self.models.values():
            m.clear()
        self.turns.clear()
        self.switches.clear()

    # -- a turn ---------------------------------------------------------------------------

    def _claim(self) -> None:
        """Close the generation left unfinished (it commits what it emitted). A session is not
        thread-safe: one generation at a time is the pair's lock (stream.py, held by the API)."""
        gen, self._active = self._active, None
        if gen is not None:
            gen.close()

    def _begin(self, model: str) -> tuple[str, int | None]:
        """Checks before any work on a turn: (the model's role, tokens the turn may add: None
        for no limit)."""
        name = role(model)
        self._claim()
        n = len(self.tokens)
        if not n:
            raise SessionError("nothing to answer yet: add a user message first")
        check_mode(self.mode, self.pair, self.forward, self.backward)
        for label, m in (("small", self.pair.source), ("large", self.pair.target)):
            if m.context_length is not None and n > m.context_length:
                raise ContextOverflowError(
                    f"the conversation is {n} tokens; the {label} model ({m.name}) handles at "
                    f"most {m.context_length}: shorten the message, drop the oldest turns with "
                    f"/trim (Session.trim) or start over with /reset"
                )
        if self.max_kv_size is not None and self.max_kv_size - n < 1:
            raise ContextOverflowError(
                f"the conversation is {n} tokens, the {name} model's context limit is "
                f"{self.max_kv_size} (max_kv_size): drop the oldest turns with /trim "
                f"(Session.trim) or start over with /reset"
            )
        self.cancelled.clear()
        return name, None if self.max_kv_size is None else self.max_kv_size - n

    def generate(self, model: str = "target", *, max_tokens: int = 256, sampler=None,
                 logits_processors=None, prefill_step_size: int = READ_CHUNK,
                 progress: Progress | None = None) -> Responses:  # fmt: skip
        """Stream an answer from `model` ('source'/'small' or 'target'/'large'): the hand-off,
        then mlx-lm decodes. Stopped early (break, `cancel()`, KeyboardInterrupt, the iterator
        closed), the tokens emitted are the answer; stopped while a model reads the turn, each
        cache keeps the chunks it read whole and the turn stays unanswered.
        `progress(reader, done, total)` is called as the turn is read, chunk by chunk (`reader`:
        "source" where the small model reads for the large one, else the answering model)."""
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
        """The turn: hand off (read, catch up, recompute), decode, commit."""
        m, t0, n0 = self.models[name], time.perf_counter(), len(self.tokens)
        stats = TurnStats(name, self.mode)
        emitted: list[int] = []
        try:
            # 1. the hand-off: the answering model's cache then holds conversation[:held]
            paths = self._hand_off(name, n0, stats, kwargs["prefill_step_size"], progress)
            if stats.finish_reason == "cancelled":
                return
            stats.ahead = self.ahead_begin(n0 - 1) if name == "source" else None
            # 2. decode with mlx-lm on the answering model's own cache
            yield from stream.decode(self, m, n0, stats, emitted, limit, capped, kwargs, t0)
        finally:
            # 3. commit, however the turn stopped
            self._commit(m, n0, emitted, stats)
        if emitted and paths is not None:  # the other path's TTFT, predicted with this turn's rates
            reader.alternative(self, stats, paths, self.tokens[:n0])

    def _hand_off(self, name: str, n0: int, stats: TurnStats, chunk: int,
                  progress: Progress | None = None) -> Paths | None:  # fmt: skip
        """The hand-off (module docstring, step 1) for `name` about to answer conversation[:n0]:
        `small_reads`, `catch_up`, `recompute` as `reader.choose` decides. Fills `stats` (a
        cancel sets its finish_reason); returns the predicted paths (None: no prediction)."""
        d = reader.choose(self, name, n0 - 1)
        stats.read_note, stats.retention, paths = d.note, d.retention, d.paths
        if paths is not None:  # what was predicted for the path taken
            stats.predicted_ttft_s = (paths.small if d.small else paths.large)(self.read_costs)
        # room for the turn and the first token: no cache grows (2x its size) while it is read
        m = self.models[name]
        reserve(m.loaded, m.cache, n0 + 1)
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

    def _commit(self, m: ModelCache, n0: int, emitted, stats: TurnStats) -> None:
        """End a turn: keep the emitted tokens as the answer and make the cache match."""
        stats.finish_reason = stats.finish_reason or "interrupted"
        if emitted:
            self.transcript.commit(n0, emitted, stats.text, m.name)
        m.settle(len(self.tokens))
        self.turns.append(stats)

    def hand_off(self, model: str = "target") -> TurnStats:
        """`generate`'s hand-off without the answer: `model`'s cache then holds all but at least
        the last token. Returns the records (who read, translated, recomputed)."""
        name, _ = self._begin(model)
        stats = TurnStats(name, self.mode)
        self._hand_off(name, len(self.tokens), stats, READ_CHUNK)
        return stats

    def escalate(self, model: str | None = None, **generate_kwargs) -> Responses:
        """Answer the last user message again with `model`, else the other model than the one
        that answered it: its last answer is dropped from the conversation and both caches,
        and the incoming model catches up by the mode. A message still unanswered (stopped
        before its first token) is answered as it is."""
        self._claim()
        if not self.pending:
            if model:
                role(model)  # an unknown name is refused before the answer is dropped
            answered = self._change(self.transcript.drop_answer)
        elif model is None and self.last_turn is None:
            raise SessionError("the last message has no answer yet: name the model to answer")
        else:
            answered = getattr(self.last_turn, "model", None)
        other = "target" if answered == "source" else "source"
        return self.generate(model or other, **generate_kwargs)

    # -- files (persistence.py) ------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write both caches, the conversation and the sync state to one mlx-lm prompt cache
        file (a `.safetensors` suffix is added where missing)."""
        self._claim()
        return persistence.save(path, self)

    def load(self, path: str | Path) -> None:
        """Restore a session saved by `save` for this same pair (refuses any other pair)."""
        self._claim()
        self.policy = persistence.load(path, self)


#: progress(reader, done, total): `reader` ("source" or "target") has read `done` of the turn's
#: `total` tokens it reads
Progress = Callable[[str, int, int], None]
Responses = Iterator[GenerationResponse]
