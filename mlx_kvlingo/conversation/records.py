"""What a conversation turn leaves behind, as plain records that touch no cache: switches, turn
statistics, streamed responses, errors, the role names, a turn's status line and the totals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

#: the two roles by size or by direction: the small model is a forward translation's source
ROLE = {"small": "source", "large": "target", "source": "source", "target": "target"}
LABEL: dict[str, Literal["small", "large"]] = {"source": "small", "target": "large"}
#: model "auto": the large model answers again where the small answer's confidence is below this
AUTO_THRESHOLD = -1.5


class SessionError(ValueError):
    """A request the session cannot honour (nothing to answer, unknown model, ...)."""


def role(model: str) -> str:
    """'source' or 'target' for any name of a role (small, large, source, target)."""
    if model not in ROLE:
        raise SessionError(f"unknown model {model!r}; use 'source'/'small' or 'target'/'large'")
    return ROLE[model]


class ContextOverflowError(SessionError):
    """The conversation does not fit a model's context (`max_kv_size`)."""


class SessionFileError(SessionError):
    """A session file that is unreadable or was written for another model pair."""


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
    #: the other way of reading this turn: its TTFT predicted from this pair's rates (rates.py)
    alternative_ttft_s: float | None = None
    predicted_ttft_s: float | None = None  # what was predicted for the path taken
    #: a cascade's small answer (model "auto"): under the threshold, the large answers again
    escalating: bool = False

    @property
    def confidence(self) -> float | None:
        return answer_confidence(self.logprobs) if self.logprobs else None


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


def answer_confidence(logprobs: Sequence[float]) -> float:
    """Mean token log-probability of an answer (0: certain), the score of model "auto"."""
    if not logprobs:
        raise ValueError("an empty answer has no confidence")
    return float(np.mean(logprobs))


def totals(s) -> dict:
    """Totals over session `s`'s conversation, per model and per direction: tokens each model
    read itself answering (`prompt_tokens`) and for the other (`read_for_other_tokens`),
    translated into it, and the times; `estimated_saving_ms` sums, over the large model's
    answers the small one read for, its predicted own TTFT less the TTFT."""
    per = {}
    for name, m in s.models.items():
        turns = [t for t in s.turns if t.model == name]
        sw = [x for x in s.switches if x.into == name]
        reads = [t.read for t in s.turns if t.read is not None and t.read.model == name]
        per[name] = {
            "turns": len(turns),
            "generated_tokens": sum(t.generation_tokens for t in turns),
            "prompt_tokens": sum(t.prompt_tokens for t in turns),
            "prompt_ms": 1e3 * sum(t.prompt_s for t in turns),
            "read_for_other_tokens": sum(r.tokens for r in reads),
            "read_for_other_ms": 1e3 * sum(r.seconds for r in reads),
            "switches_into": len(sw),
            "translated_into": sum(x.translated for x in sw),
            "retranslated_into": sum(x.retranslated for x in sw),
            "translate_ms": 1e3 * sum(x.seconds for x in sw if x.translated),
            "held": m.held,
        }
    saved = sum(t.alternative_ttft_s - t.ttft_s for t in s.turns if t.read is not None
                and t.alternative_ttft_s is not None and t.ttft_s is not None)  # fmt: skip
    return {"mode": s.mode, **s.policy.to_dict(), "conversation_tokens": len(s.tokens),
            "messages": len(s.messages), "switches": len(s.switches),
            "retemplated": s.retemplated, "estimated_saving_ms": 1e3 * saved,
            "models": per}  # fmt: skip


def share(x: float) -> str:
    """A retention with two decimals, rounded down: one under a threshold never reads as it."""
    return f"{math.floor(x * 100 + 1e-9) / 100:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def status_line(st: TurnStats, names: dict) -> str:
    """Who read what and what it cost, then mlx-lm's `N tokens · X tok/s · peak Z GB`.

    With the small model reading: `small read 18 tok 35 ms · translated 19 tok 5 ms · large
    read 1 tok 20 ms · TTFT 60 ms (large alone: TTFT ≈ 400 ms) · ...`: the path not
    taken, as a TTFT predicted from the rates measured on this pair.
    """
    me = LABEL[st.model]
    parts = [f"{me} ({names[st.model]})"]
    rd, sw = st.read, st.switch
    if rd is not None:
        other = LABEL[rd.model]
        c = rd.catch_up
        if c is not None and c.translated:
            parts.append(
                f"{other} got the last answer translated ({c.translated} tok {_ms(c.seconds)})"
            )
        elif c is not None:
            parts.append(
                f"{other} re-read the last answer ({c.lacked} tok, {c.note or 're-prefill'})"
            )
        parts.append(f"{other} read {rd.tokens} tok {_ms(rd.seconds)}")
    if sw is not None:
        if sw.translated:
            again = f" ({sw.retranslated} again)" if sw.retranslated else ""
            parts.append(f"translated {sw.translated} tok{again} {sw.seconds * 1e3:.1f} ms")
            if sw.tail_read:
                parts.append(f"{me} read the last {sw.tail_read} tok and recomputed "
                             f"{sw.recomputed} translated tok {_ms(sw.recompute_s)}")  # fmt: skip
        else:
            parts.append(f"switch {sw.lacked} tok {sw.note or 're-prefill'}")
    # its read time, as mlx-lm measures it (up to its first token): with the parts before it
    # the status line accounts for the TTFT
    read = f"{me} read {st.prompt_tokens} tok"
    read += f" {_ms(st.prompt_s)}" if st.prompt_tokens and st.prompt_s else ""
    read += f" {st.prompt_tps:.1f} tok/s" if st.prompt_tokens > 1 else ""
    parts.append(read + (f" ({st.read_note})" if st.read_note else ""))
    if st.ttft_s is not None:
        ttft = f"TTFT {_ms(st.ttft_s)}"
        alt = st.alternative_ttft_s
        if alt is not None and st.model == "target":
            other = f"{me} alone" if rd is not None else f"{LABEL['source']} + translation"
            why = ""
            if rd is None and st.retention is not None and alt < st.ttft_s:
                why = f", {_ms(st.ttft_s - alt)} sooner, keeping ≈{share(st.retention)}"
            ttft += f" ({other}: TTFT ≈ {_ms(alt)}{why})"
        parts.append(ttft)
    if st.ahead is not None and st.ahead.translated:
        parts.append(f"translated ahead for {LABEL['target']} {st.ahead.translated} tok "
                     f"{_ms(st.ahead.seconds)}")  # fmt: skip
    parts.append(f"{st.generation_tokens} tokens {st.generation_tps:.1f} tok/s")
    parts.append(f"peak {st.peak_memory_gb:.2f} GB")
    if st.finish_reason in ("cancelled", "interrupted"):
        parts.append("stopped")
    elif st.finish_reason == "context":
        parts.append("context full (/trim or /reset)")
    return " · ".join(parts)
