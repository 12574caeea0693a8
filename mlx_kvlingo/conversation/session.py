"""One conversation, two models, each with its own cache: the turn loop, top to bottom.

Invariant: the conversation is one list of token ids (`Transcript`); each model's mlx-lm cache
holds a prefix of it, `held` tokens long, in every layer (`ModelCache`). Every change to the
conversation cuts both caches to the prefix they still share with it, and a turn always ends in
`_commit`, however it stops (end, max tokens, `cancel()`, Ctrl-C, the iterator closed or
collected): the emitted tokens become the answer and the cache is cut to match. No span is
translated twice.

A turn (`generate`):

    1. hand-off (`_hand_off`)  who reads the turn (reader.py, decided once into a `Decision`):
                               the small model reads it, the span the large lacks is translated,
                               the large reads the last tokens and recomputes (catchup.py); or
                               the answering model catches up by the mode and reads the rest;
    2. decode (decode.py)      mlx-lm's `stream_generate` on the answering model's own cache,
                               reading at least the last conversation token itself;
    3. commit (`_commit`)      the emitted tokens become the answer, the cache is cut to match.

Modes: `alternation` translates only the span the other model holds and this one lacks, at its
true positions; `naive` re-translates everything the other model holds (the drifting baseline);
`reprefill` reads it all (the exact reference). Nothing here prints: `generate` yields
mlx-lm-shaped `GenerationResponse`s (the last carries the turn's `TurnStats` as `handoff`), and
every turn leaves its `TurnStats` in `Session.turns`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mlx_kvlingo.config import READERS, ReaderPolicy
from mlx_kvlingo.conversation import persistence, reader
from mlx_kvlingo.conversation.catchup import (
    MODES,
    READ_CHUNK,
    CatchUp,
    ModelCache,
    RemoteLarge,
    check_directions,
)
from mlx_kvlingo.conversation.decode import decode, room
from mlx_kvlingo.conversation.rates import Paths, ReadCosts, costs_of
from mlx_kvlingo.conversation.records import (
    GenerationResponse,
    SessionError,
    TurnStats,
    role,
    totals,
)
from mlx_kvlingo.conversation.retention import Retention
from mlx_kvlingo.conversation.transcript import Transcript
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair


def _kept(part: str, name: str, doc: str) -> property:
    """An attribute one of the session's parts keeps, read and set through the session."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, v: setattr(getattr(self, part), name, v), doc=doc)  # fmt: skip


class Session:
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
        #: the large model's cache on other ranks (distributed/): what is gathered from it and
        #: placed into it goes through `remote`; it cannot recompute, save or load
        self.remote = remote
        self.max_kv_size = max_kv_size  # the conversation's token limit (None: none)
        self.transcript = Transcript(pair.tokenizer, system_prompt)
        self.models = {n: ModelCache(n, getattr(pair, n), new_cache(getattr(pair, n)))
                       for n in ("source", "target")}  # fmt: skip
        self.turns: list[TurnStats] = []
        self.switches: list = []  # every `Switch`, in order
        self._cancel = threading.Event()
        self._active: Responses | None = None  # the generation left open
        #: catching up and who reads a turn: the mode, the reader policy, the read costs
        self.catchup = CatchUp(pair, forward, backward, transcript=self.transcript,
                               models=self.models, switches=self.switches, cancel=self._cancel,
                               read_costs=costs_of(pair) if read_costs is None else read_costs,
                               remote=remote, mode=mode, policy=policy,
                               retention=retention)  # fmt: skip

    mode = _kept("catchup", "mode", "alternation, naive or reprefill (catchup.py)")
    policy = _kept("catchup", "policy", "who reads a turn and what the large model recomputes "
                   "(mlx_kvlingo/config.py), its reader resolved ('auto' with a forward "
                   "translator, else 'self'); change it with dataclasses.replace")  # fmt: skip
    read_costs = _kept("catchup", "read_costs", "what reading costs on this pair (reader auto)")
    retention = _kept("catchup", "retention", "what the forward translator keeps of the content "
                      "by length under this policy (reader auto; retention.py)")  # fmt: skip
    tokens = _kept("transcript", "tokens", "the conversation's token ids")
    messages = _kept("transcript", "messages", "the role/content dicts of the conversation")
    system_prompt = _kept("transcript", "system_prompt", "the system message (reset keeps it)")
    retemplated = _kept("transcript", "retemplated", "times a template was not prefix-stable")
    pending = _kept("transcript", "pending", "the last message is a user's, not answered yet")

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
        self._cancel.set()

    def stats(self) -> dict:
        """Totals over the conversation, per model and per direction (`records.totals`)."""
        return totals(self)

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
        self._claim()
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
        thread-safe: one generation at a time is the pair's lock (lock.py, held by the API)."""
        gen, self._active = self._active, None
        if gen is not None:
            gen.close()

    def _begin(self, model: str) -> tuple[str, int | None]:
        """Checks before any work on a turn: (the model's role, tokens the turn may add: None
        for no limit; decode.room)."""
        name = role(model)
        self._claim()
        n = len(self.tokens)
        if not n:
            raise SessionError("nothing to answer yet: add a user message first")
        self.catchup.check_mode()
        left = room(self.pair, n, name, self.max_kv_size)
        self._cancel.clear()
        return name, left

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
        gen = self._generate(name, limit, limit != max_tokens, kwargs, progress)
        self._active = gen
        return gen

    def _generate(self, name: str, limit: int, capped: bool, kwargs,
                  progress: Progress | None = None) -> Responses:  # fmt: skip
        """The turn: hand off (read, catch up, recompute), decode, commit."""
        m, catchup = self.models[name], self.catchup
        t0 = time.perf_counter()
        n0 = len(self.tokens)
        stats = TurnStats(name, self.mode)
        emitted: list[int] = []
        paths = None
        try:
            # 1. the hand-off: whoever reads the turn, the answering model's cache then holds
            #    conversation[:held] and the rest (at least the last token) is its prompt
            paths = self._hand_off(name, n0, stats, kwargs["prefill_step_size"], progress)
            if stats.finish_reason == "cancelled":
                return
            ahead = catchup.ahead_begin(n0 - 1) if name == "source" else None
            stats.ahead = ahead
            prompt = self.tokens[m.held :]
            stats.prompt_tokens = len(prompt)
            # 2. decode with mlx-lm on the answering model's own cache
            step = None if ahead is None else lambda s: catchup.ahead_step(ahead, n0 - 1, s)
            yield from decode(m, self.transcript, prompt, stats, emitted, limit=limit,
                              capped=capped, kwargs=kwargs, t0=t0, cancel=self._cancel,
                              first=lambda: catchup.observe(stats, n0 - len(prompt)),
                              between=step)  # fmt: skip
        finally:
            # 3. commit, however the turn stopped
            self._commit(m, n0, emitted, stats)
        if emitted and paths is not None:  # the other path's TTFT, predicted with this turn's rates
            catchup.alternative(stats, paths, self.tokens[:n0])

    def _hand_off(self, name: str, n0: int, stats: TurnStats, chunk: int,
                  progress: Progress | None = None) -> Paths | None:  # fmt: skip
        """The one hand-off, for the model `name` about to answer conversation[:n0]:

            the small model reads the turn           (reader "small": `small_reads`)
            translate the span the large one lacks   (`catch_up`)
            the large reads the turn's last tokens   (`large_reads_last`)
            and recomputes what it attended to most  (`recompute_share`: `recompute`)

        leaving conversation[held:n0] (at least the last token) for the first step. Where the
        large reads the turn itself, only the catch-up runs. Fills `stats` (a cancel sets its
        finish_reason) and returns the predicted paths (None where no prediction applies)."""
        catchup, d = self.catchup, reader.choose(self.catchup, name, n0 - 1)
        stats.read_note, stats.retention, paths = d.note, d.retention, d.paths
        if paths is not None:  # what was predicted for the path taken
            stats.predicted_ttft_s = (paths.small if d.small else paths.large)(self.read_costs)
        # room for the turn and the first token: no cache grows (2x its size) while it is read
        self.models[name].reserve(n0 + 1)
        upto = n0 - 1  # the answering model reads at least the last token itself
        if d.small:  # the large still reads the turn's last tokens itself (from d.cut)
            upto = d.cut
            stats.read = catchup.small_reads(upto, chunk, progress)
            if self._cancel.is_set():  # stopped while the small model read
                stats.finish_reason = "cancelled"
                return paths
        stats.switch = sw = catchup.catch_up(name, upto)
        if d.recompute and sw is not None and sw.translated:  # the tail, then the recompute
            catchup.recompute(sw, n0)
            if self._cancel.is_set():
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
        """Bring `model` up to the conversation without answering: `generate`'s hand-off. Its
        cache then holds conversation[:held(model)], the rest (at least the last token) the
        prompt of its first step. Returns the records (who read, translated, recomputed)."""
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


__all__ = ["MODES", "READERS", "Session"]
