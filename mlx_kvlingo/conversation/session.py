"""Alternation: one conversation, two models, each with its own cache.

The conversation is one list of token ids. Each model's mlx-lm cache holds a prefix of it,
`held` tokens long. When a model is asked to answer, it first catches up on what it lacks:

    alternation  translate the span the other model holds and this one lacks (only that
                 span, appended at its true absolute positions), then read the rest itself;
    naive        rebuild this model's cache by translating everything the other model holds,
                 so spans that came from translation are translated again (the baseline that
                 drifts turn after turn);
    reprefill    read everything it lacks itself (the exact reference, and the slow one).

Reader policy. With `reader="small"`, before the large model answers: the small model
catches up on the large's last answer (backward translation, or it reads it itself), reads
the new user turn itself (prefill only), and the large catches up by translating exactly the
span it lacks. With `reader="self"` the answering model reads what it lacks itself.
`reader="auto"` (the default whenever a forward translator is loaded) picks, turn by turn,
whichever starts the answer sooner, predicted from rates measured on this pair in this
process (conversation/timing.py):

    large reads   target_read(lacked)                        its prefill plus its first step
    small reads   catch-up + source_read + forward(lacked - tail) + target_read(tail)
                  (target_step for a tail of one token; tail: `large_reads_last`)

When the two are within `reader_margin` (5%) of each other, or before the rates are
measured, the token rule decides: `reader="tokens"` is "small" for the opening span and for
spans of at least `reader_min_tokens` (64) tokens, "self" for shorter later turns (a short
translated turn between the large's native answers is where translation loses the most
quality: its later answers drift to earlier topics). No span is translated twice.

When the small model reads for the large one, the large still reads the turn's last
`large_reads_last` tokens itself, on the translated rest (`Runtime`'s conversations: 32; a bare
`Session`: 1, the plain handoff): the user's question in the target's own K/V. A translated
short message keeps its topic and loses its request ("suggest a name for my cat" answered with
what a pet-care assistant can do); read by the large model, it is answered as on the native
cache, and the earlier context (the system prompt, earlier turns, a long passage) still comes
translated (weights/QUALITY.md, "In a chat: the large model reads the turn's last 32 tokens").
With `recompute_share` > 0 it then recomputes that share of the span just translated, the tokens
its reading of the tail attended to most (conversation/catchup.py, recompute.py). Where that read is predicted to more than double the plain handoff's TTFT and to
add more than half a second (`catchup.TAIL_BUDGET`, `TAIL_ALLOWANCE_S`: an MoE target's
prefill on the CPU), the large reads only the last token, and the status line says so.

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

import threading
from dataclasses import replace

from mlx_kvlingo.config import READERS, ReaderPolicy
from mlx_kvlingo.conversation.answering import Answering
from mlx_kvlingo.conversation.budget import AheadBudget
from mlx_kvlingo.conversation.catchup import CatchUp, RemoteLarge, _Model
from mlx_kvlingo.conversation.messages import Messages
from mlx_kvlingo.conversation.persistence import MODELS, Persistence
from mlx_kvlingo.conversation.records import SessionError, Switch, TurnStats
from mlx_kvlingo.conversation.timing import ReadCosts, costs_of
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.translator import Side, Translator
from mlx_kvlingo.models.pair import ModelPair

MODES = ("alternation", "naive", "reprefill")


class Session(Messages, CatchUp, Answering, Persistence):
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
        policy: ReaderPolicy | None = None,
        read_costs: ReadCosts | None = None,
        remote: RemoteLarge | None = None,
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
        #: the large model's cache on other ranks (distributed/): what is gathered from it and
        #: placed into it goes through `remote`; it cannot recompute, save or load
        self.remote = remote
        #: who reads a turn and what the large model recomputes (mlx_kvlingo/config.py)
        self.policy = ReaderPolicy() if policy is None else policy
        #: what reading costs on this pair (reader "auto"); shared by the pair's sessions
        self.read_costs = costs_of(pair) if read_costs is None else read_costs
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

    @property
    def policy(self) -> ReaderPolicy:
        """The reader policy, its reader resolved ("auto" with a forward translator, else
        "self"). Change it with `session.policy = dataclasses.replace(session.policy, ...)`."""
        return self._policy

    @policy.setter
    def policy(self, policy: ReaderPolicy) -> None:
        if not isinstance(policy, ReaderPolicy):
            raise SessionError(f"policy must be a ReaderPolicy (got {type(policy).__name__})")
        if self.remote is not None and policy.recompute_share:  # all layers, in this process
            raise SessionError(
                "the recompute (recompute_share > 0) is not available with a pipelined large model"
            )
        reader = policy.reader or ("auto" if self.forward else "self")
        if reader != "self" and self.forward is None:
            raise SessionError(f"reader {reader!r} needs a forward (small -> large) translator")
        self._policy = replace(policy, reader=reader)
        #: while the small model answers, translate for the large one between its tokens, so
        #: an escalation costs about one large decode step plus what is left: at most
        #: `ahead_share` of the small model's decode time (see conversation/budget.py), or,
        #: with `ahead_share=None`, `ahead_chunk` tokens after every small token
        share = policy.ahead_share
        self._ahead_budget = None if share is None else AheadBudget(share)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self._claim()
        self.tokens: list[int] = []
        self.messages: list[dict] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        self._models = {
            "source": _Model("source", self.pair.source, new_cache(self.pair.source)),
            "target": _Model("target", self.pair.target, new_cache(self.pair.target)),
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
        """Totals over the conversation, per model and per direction.

        Per model: tokens it read itself while answering (`prompt_tokens`) and while reading
        for the other model (`read_for_other_tokens`), tokens translated into it, and the
        times; `estimated_saving_ms` sums, over the large model's answers that the small one
        read for, its estimated own prefill minus what reading and translating cost.
        """
        per = {}
        for name in MODELS:
            turns = [t for t in self.turns if t.model == name]
            sw = [s for s in self.switches if s.into == name]
            reads = [t.read for t in self.turns if t.read is not None and t.read.model == name]
            per[name] = {
                "turns": len(turns),
                "generated_tokens": sum(t.generation_tokens for t in turns),
                "prompt_tokens": sum(t.prompt_tokens for t in turns),
                "prompt_ms": 1e3 * sum(t.prompt_s for t in turns),
                "read_for_other_tokens": sum(r.tokens for r in reads),
                "read_for_other_ms": 1e3 * sum(r.seconds for r in reads),
                "switches_into": len(sw),
                "translated_into": sum(s.translated for s in sw),
                "retranslated_into": sum(s.retranslated for s in sw),
                "translate_ms": 1e3 * sum(s.seconds for s in sw if s.translated),
                "held": self._models[name].held,
            }
        saved = 0.0  # the small read: the large's predicted TTFT reading itself, less the TTFT
        for t in self.turns:
            if t.read is not None and t.alternative_ttft_s is not None and t.ttft_s is not None:
                saved += t.alternative_ttft_s - t.ttft_s
        return {
            "mode": self.mode,
            **self.policy.to_dict(),
            "conversation_tokens": len(self.tokens),
            "messages": len(self.messages),
            "switches": len(self.switches),
            "retemplated": self.retemplated,
            "estimated_saving_ms": 1e3 * saved,
            "models": per,
        }

    def cancel(self) -> None:
        """Ask the running generation to stop after its current token (any thread)."""
        self._cancel.set()


__all__ = ["MODES", "READERS", "Session"]
