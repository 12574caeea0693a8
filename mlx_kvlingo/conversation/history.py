"""The conversation's state (its transcript, both models' caches, its turns and switches), its
changes between turns and its totals. Each change changes the transcript, then cuts both caches
to the prefix they still share with it.

Invariant: after every change, each model's cache holds a prefix of the conversation (its
`held` at most the tokens the old and the new conversation share), so whichever model answers
next catches up on the rest like any span it lacks. The session closes the generation it left
open before any of these runs (`Session._claim`: that commits what it emitted first).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.catchup import ModelCache
from mlx_kvlingo.conversation.records import SessionError, Switch, TurnStats, role
from mlx_kvlingo.conversation.transcript import Transcript
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.models.pair import ModelPair


class History:
    """A conversation over `pair`: the token list and its messages (`transcript`), each
    model's cache of a prefix of it (`models`), what every turn and switch recorded."""

    def __init__(self, pair: ModelPair, system_prompt: str | None, max_kv_size: int | None):
        self.transcript = Transcript(pair.tokenizer, system_prompt)
        self.models = {
            n: ModelCache(n, getattr(pair, n), new_cache(getattr(pair, n)))
            for n in ("source", "target")
        }
        self.turns: list[TurnStats] = []
        self.switches: list[Switch] = []
        self.max_kv_size = max_kv_size

    def cut(self, keep: int) -> None:
        """Both caches hold at most the first `keep` conversation tokens."""
        for m in self.models.values():
            m.settle(min(m.held, keep))

    def add_user(self, text: str) -> list[int]:
        """Append a user message (and the template's generation prompt); return its tokens.

        An earlier user message that never got an answer (generation stopped before its first
        token) is replaced.
        """
        start, keep = self.transcript.add_user(text)
        self.cut(keep)
        return self.transcript.tokens[start:]

    def add_assistant(self, text: str) -> list[int]:
        """Append an answer given as text (history from elsewhere); return its tokens.

        Nothing reads it now: whichever model answers next catches up on it like any span it
        lacks. It cannot be escalated (no model produced it).
        """
        start, keep = self.transcript.add_assistant(text)
        self.cut(keep)
        return self.transcript.tokens[start:]

    def add_tokens(self, tokens: Sequence[int]) -> None:
        """Append raw token ids to the conversation (no template; for tests and tools)."""
        self.transcript.tokens.extend(int(t) for t in tokens)

    def trim(self, max_tokens: int | None = None) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens.

        Default: half of `max_kv_size`. The system prompt and the last message stay. Later
        tokens move to new positions, so both caches are cut to the prefix the shortened
        conversation shares with the old one (usually the system prompt) and the next
        answering model re-reads the rest. Returns the number of messages dropped.
        """
        if max_tokens is None:
            if self.max_kv_size is None:
                raise SessionError("trim needs a token budget (or a session max_kv_size)")
            max_tokens = self.max_kv_size // 2
        dropped, keep = self.transcript.trim(max_tokens)
        self.cut(keep)
        return dropped

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self.transcript.reset()
        for m in self.models.values():
            m.clear()
        self.turns.clear()
        self.switches.clear()

    def escalation(self, model: str | None = None) -> str:
        """Who answers the last user message again: `model`, else the other model than the one
        that answered it. Its last answer is dropped from the conversation and both caches (a
        message still unanswered, e.g. stopped before its first token, is answered as it is)."""
        if self.transcript.pending:
            last = self.turns[-1] if self.turns else None
            if model is None and last is None:
                raise SessionError("the last message has no answer yet: name the model to answer")
            return model or ("target" if last.model == "source" else "source")
        if model:
            role(model)  # an unknown name is refused before the answer is dropped
        start, answered = self.transcript.drop_answer()
        self.cut(start)
        return model or ("target" if answered == "source" else "source")

    def stats(self, mode: str, policy: ReaderPolicy) -> dict:
        """Totals over the conversation, per model and per direction (`Session.stats`)."""
        per = {}
        for name, m in self.models.items():
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
                "held": m.held,
            }
        # the small read: the large's predicted TTFT reading itself, less the TTFT
        saved = sum(t.alternative_ttft_s - t.ttft_s for t in self.turns if t.read is not None
                    and t.alternative_ttft_s is not None and t.ttft_s is not None)  # fmt: skip
        return {
            "mode": mode,
            **policy.to_dict(),
            "conversation_tokens": len(self.transcript.tokens),
            "messages": len(self.transcript.messages),
            "switches": len(self.switches),
            "retemplated": self.transcript.retemplated,
            "estimated_saving_ms": 1e3 * saved,
            "models": per,
        }
