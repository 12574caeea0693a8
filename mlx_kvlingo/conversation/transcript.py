"""The conversation's record: its token list and messages (`Transcript`) and what each turn did
(`Switch`, `Read`, `TurnStats`; `totals`), plain data that touches no cache; errors, role names.

Invariant: `tokens` is the chat template applied to `messages` (the token ids every cache
holds a prefix of). A new message is appended as the tokens the template adds (token diff,
else text diff, else re-tokenize everything). Each change returns `keep`, how many of the old
tokens are still the conversation's, and the session cuts both caches to it. `user_start` is
where an unanswered user message starts, `answer` the (start, model) of the last answer a model
gave (None for one given as text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

#: the two roles by size or by direction: the small model is a forward translation's source
ROLE = {"small": "source", "large": "target", "source": "source", "target": "target"}
LABEL: dict[str, Literal["small", "large"]] = {"source": "small", "target": "large"}


class SessionError(ValueError):
    """A request the session cannot honour (nothing to answer, unknown model, ...)."""


class ContextOverflowError(SessionError):
    """The conversation does not fit a model's context (`max_kv_size`)."""


class SessionFileError(SessionError):
    """A session file that is unreadable or was written for another model pair."""


def role(model: str) -> str:
    """'source' or 'target' for any name of a role (small, large, source, target)."""
    if model not in ROLE:
        raise SessionError(f"unknown model {model!r}; use 'source'/'small' or 'target'/'large'")
    return ROLE[model]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Transcript:
    """The token list, the messages, the system prompt; templating a message into tokens."""

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.messages: list[dict] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        self.user_start: int | None = None
        self.answer: tuple[int, str] | None = None
        self.retemplated = 0  # times a template was not prefix-stable (caches trimmed)

    @property
    def pending(self) -> bool:
        """True when the conversation ends with a user message that has no answer yet."""
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def cut(self, n: int) -> int:
        """Cut the conversation to its first n tokens (the messages stay); returns n."""
        self.tokens = self.tokens[:n]
        if self.answer and self.answer[0] >= n:
            self.answer = None
        return n

    # -- changes (each returns `keep`: the caches hold at most that many tokens) -----------

    def add_user(self, text: str) -> tuple[int, int]:
        """Append a user message; an earlier one that never got an answer is replaced.
        Returns (where its tokens start, keep)."""
        keep = len(self.tokens)
        if self.pending and self.user_start is not None:
            keep = self.cut(self.user_start)
            self.messages.pop()
        start, kept = self.append({"role": "user", "content": text}, True)
        self.user_start = start
        return start, min(keep, kept)

    def add_assistant(self, text: str) -> tuple[int, int]:
        if not self.pending:
            raise SessionError("an assistant message must follow a user message")
        start, keep = self.append({"role": "assistant", "content": text}, False)
        self.answer = self.user_start = None
        return start, keep

    def drop_answer(self) -> tuple[int, str]:
        """Remove the last answer a model gave: (that model, keep: where it started)."""
        if self.answer is None or not self.messages or self.messages[-1]["role"] != "assistant":
            raise SessionError("nothing to escalate: there is no answer yet")
        start, answered = self.answer
        self.cut(start)
        self.messages.pop()
        self.answer = self.user_start = None
        return answered, start

    def commit(self, n0: int, emitted: list[int], text: str, model: str) -> None:
        """Keep the tokens a model emitted after conversation[:n0] as its answer."""
        self.tokens = self.tokens[:n0] + list(emitted)
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.answer is not None:
            last["content"] += text  # a continuation of the last answer
        else:
            self.messages.append({"role": "assistant", "content": text})
            self.answer = (n0, model)
        self.user_start = None

    def answers(self) -> list[int]:
        """The token ids of the conversation's earlier answers, oldest first."""
        tok = self.tokenizer
        return [t for msg in self.messages if msg["role"] == "assistant" and msg["content"]
                for t in tok.encode(msg["content"], add_special_tokens=False)]  # fmt: skip

    # -- templating ----------------------------------------------------------------------

    def _has_template(self) -> bool:
        has = getattr(self.tokenizer, "has_chat_template", None)
        return bool(getattr(self.tokenizer, "chat_template", None)) if has is None else has

    def template(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        tok = self.tokenizer
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
        if not self._has_template():
            return None
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def append(self, message: dict, generation_prompt: bool) -> tuple[int, int]:
        """Append `message` as the tokens the chat template adds: (where they start, keep).

        1. token diff: the templated conversation extends the tokens so far;
        2. text diff: the templated text extends the decoded conversation (answers whose
           re-tokenization differs from the generated tokens), encode only the new text;
        3. otherwise re-tokenize everything; keep the common prefix.
        """
        messages = self.messages + [message]
        full = self.template(messages, generation_prompt)
        n = keep = len(self.tokens)
        if full[:n] == self.tokens:
            self.tokens, start = full, n
        elif (new := self._text_diff(messages, generation_prompt)) is not None:
            self.tokens, start = self.tokens + new, n
        else:
            gp = message["role"] == "assistant"
            before = self.template(self.messages, gp) if self.messages else []
            keep = self.cut(common_prefix(self.tokens, full))
            start = len(before) if full[: len(before)] == before else keep
            self.tokens = full
            self.retemplated += 1
        self.messages.append(message)
        return start, keep

    def _text_diff(self, messages: list[dict], generation_prompt: bool) -> list[int] | None:
        """The new message's tokens from the templated text, or None if that is not possible.

        After a generated answer, anchor on the answer's text: whatever the template puts
        after it (closing the turn, the new message) is encoded and appended, so answers
        whose re-tokenization differs from the generated tokens keep their cache.
        """
        tok = self.tokenizer
        text = self._render(messages, generation_prompt)
        if text is None:
            return None
        last = self.messages[-1] if self.messages else None
        if self.answer is not None and last and last["role"] == "assistant" and last["content"]:
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

    def trim(self, max_tokens: int) -> tuple[int, int]:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens (the
        system prompt and the last message stay): (messages dropped, keep)."""
        head = (
            self.messages[:1] if self.messages[:1] and self.messages[0]["role"] == "system" else []
        )
        rest = self.messages[len(head) :]
        dropped = 0
        gp = bool(rest) and rest[-1]["role"] == "user"
        while len(rest) > 1 and len(self.template(head + rest, gp)) > max_tokens:
            rest = rest[1:]
            dropped += 1
            while len(rest) > 1 and rest[0]["role"] != "user":  # start on a user turn
                rest = rest[1:]
                dropped += 1
        if not dropped:
            return 0, len(self.tokens)
        full = self.template(head + rest, gp)
        if len(full) > max_tokens:
            raise ContextOverflowError(
                f"even the last message alone is {len(full)} tokens, over the {max_tokens} budget"
            )
        keep = self.cut(common_prefix(self.tokens, full))
        self.tokens, self.messages = full, head + rest
        self.answer = self.user_start = None
        if gp:  # the kept last message awaits its answer
            before = self.template(head + rest[:-1], False) if head or rest[:-1] else []
            if full[: len(before)] == before:
                self.user_start = len(before)
        return dropped, keep


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
    #: after the translation, the large model read the turn's last `tail_read` tokens itself
    #: and recomputed `recomputed` translated tokens that reading attended to most
    #: (the policy's `recompute_share`), in `recompute_s`
    recomputed: int = 0
    tail_read: int = 0
    recompute_s: float = 0.0

    @property
    def lacked(self) -> int:
        return self.end - self.start

    @property
    def translated_span(self) -> tuple[int, int] | None:
        return (self.end - self.translated, self.end) if self.translated else None


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
    ahead: Switch | None = None  # translated ahead for the large model during this answer
    prompt_s: float = 0.0  # the answering model's own prefill time this turn
    #: the small model read: the large model's predicted TTFT reading the turn itself (old name)
    alone_prefill_s: float | None = None
    read_note: str = ""  # why the large read the new turn itself (readers "auto", "tokens")
    #: reader "auto" turned the faster small path down: the retention expected at this length
    retention: float | None = None
    #: the other way of reading this turn: its TTFT predicted from this pair's rates (reader.py)
    alternative_ttft_s: float | None = None
    predicted_ttft_s: float | None = None  # what was predicted for the path taken
    #: a cascade's small answer (model "auto"): under the threshold, the large answers again
    escalating: bool = False

    @property
    def confidence(self) -> float | None:
        """Mean token log-probability of the answer (0: certain), the score of model "auto"."""
        return float(np.mean(self.logprobs)) if self.logprobs else None


def totals(t: Transcript, turns: list[TurnStats], switches: list[Switch], models: dict) -> dict:
    """A conversation's totals, per model (`models`: each model's cache, `held`) and direction:
    tokens each model read itself answering (`prompt_tokens`) and for the other
    (`read_for_other_tokens`), translated into it, and the times; `estimated_saving_ms` sums,
    over the large model's answers the small one read for, its predicted own TTFT less the TTFT."""
    per = {}
    for name, m in models.items():
        mine = [t for t in turns if t.model == name]
        sw = [x for x in switches if x.into == name]
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
    return {"conversation_tokens": len(t.tokens), "messages": len(t.messages),
            "switches": len(switches), "retemplated": t.retemplated,
            "estimated_saving_ms": 1e3 * saved, "models": per}  # fmt: skip


@dataclass
class GenerationResponse:
    """mlx-lm's `GenerationResponse` (its fields, in its order), plus who answered and, on an
    answer's last response (`finish_reason` set), the hand-off record (`handoff`: who read, what
    was translated and recomputed, where the time went) and the `status` line. An answer stopped
    before its first token ends with a response whose `token` is None."""

    text: str
    token: int | None
    logprobs: Any  # mx.array: the log-probabilities over the vocabulary (None: no token)
    from_draft: bool
    prompt_tokens: int  # tokens the answering model read itself
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None
    model: str = "large"  # "small" or "large"
    handoff: TurnStats | None = None
    status: str = ""
