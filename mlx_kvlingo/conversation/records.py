"""What a conversation turn leaves behind: switches, turn statistics, streamed tokens, errors,
and the one-line status that `kvlingo chat` and the API print for a turn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

LABEL = {"source": "small", "target": "large"}


class SessionError(ValueError):
    """A request the session cannot honour (nothing to answer, unknown model, ...)."""


class ContextOverflowError(SessionError):
    """The conversation does not fit a model's context (`max_kv_size`)."""


class SessionFileError(SessionError):
    """A session file that is unreadable or was written for another model pair."""


class SessionBusyError(RuntimeError):
    """A generation is already running on this session."""


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

    @property
    def lacked(self) -> int:
        return self.end - self.start

    @property
    def translated_span(self) -> tuple[int, int] | None:
        return (self.end - self.translated, self.end) if self.translated else None


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

    @property
    def confidence(self) -> float | None:
        return answer_confidence(self.logprobs) if self.logprobs else None


@dataclass
class TokenEvent:
    """One streamed token. The turn's last event carries its `stats`."""

    text: str
    token: int | None
    logprob: float | None
    model: str
    stats: TurnStats | None = None


def answer_confidence(logprobs: Sequence[float]) -> float:
    """Mean token log-probability of an answer: 0 is certain, more negative is less sure.

    This is the `/auto` cascade's score: the small model answers, and the large one takes
    over when the score falls below a threshold.
    """
    if not logprobs:
        raise ValueError("an empty answer has no confidence")
    return float(np.mean(logprobs))


def status_line(st: TurnStats, names: dict) -> str:
    """mlx-lm's `N tokens · X tok/s · prompt Y tok/s · peak Z GB`, plus model, TTFT, switch."""
    parts = [f"{LABEL[st.model]} ({names[st.model]})"]
    parts.append(f"{st.generation_tokens} tokens")
    parts.append(f"{st.generation_tps:.1f} tok/s")
    parts.append(f"prompt {st.prompt_tokens} tok {st.prompt_tps:.1f} tok/s")
    if st.ttft_s is not None:
        parts.append(f"TTFT {st.ttft_s * 1e3:.0f} ms")
    sw = st.switch
    if sw is not None:
        if sw.translated:
            again = f" ({sw.retranslated} again)" if sw.retranslated else ""
            parts.append(f"switch {sw.translated} tok translated{again} {sw.seconds * 1e3:.1f} ms")
        else:
            parts.append(f"switch {sw.lacked} tok {sw.note or 're-prefill'}")
    parts.append(f"peak {st.peak_memory_gb:.2f} GB")
    if st.finish_reason in ("cancelled", "interrupted"):
        parts.append("stopped")
    elif st.finish_reason == "context":
        parts.append("context full (/trim or /reset)")
    return " · ".join(parts)
