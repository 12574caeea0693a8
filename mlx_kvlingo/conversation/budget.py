"""How much to translate ahead between two of the small model's tokens.

Translating ahead (see `catchup.py`) slows the small model's answer by the time it takes. The
budget caps that at a `share` of the small model's own decode time: each small token earns
`share` x its decode time in credit, and a chunk is translated only when the credit covers its
predicted cost. The cost of a chunk of n tokens is modelled as `per_call + per_token * n`
(per-call work: reading the translator's weights, one append per layer), fitted on the chunks
translated so far; the budget waits for a chunk large enough that its per-call cost is at most
a quarter of its cost. A chunk that overruns its
prediction leaves a debt that later tokens pay back: over an answer, translation time stays
within `share` of decode time plus at most one chunk. What is not translated when the answer
ends is left for the escalation (or kept for the next turn; nothing is translated twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: chunks below this are not worth a call when the per-call cost dominates
MIN_CHUNK = 8


@dataclass
class AheadBudget:
    share: float = 0.10
    credit: float = 0.0  # seconds of translation the small model's tokens have paid for
    history: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)

    def __post_init__(self):
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"ahead share must be in (0, 1], not {self.share!r}")

    def earn(self, decode_s: float) -> None:
        """One small-model token took `decode_s` seconds to decode."""
        self.credit += self.share * max(0.0, decode_s)

    def _fit(self) -> tuple[float, float] | None:
        """(per_call, per_token) seconds from the recent chunks; None until two sizes."""
        ns, ts = np.array(self.history[-16:], dtype=float).T
        if len(set(ns)) < 2:
            return None
        b, a = np.polyfit(ns, ts, 1)
        return max(a, 0.0), max(b, 1e-9)

    def cost(self, n: int) -> float | None:
        """Predicted seconds to translate n tokens; None before the first chunk."""
        if not self.history:
            return None
        fit = self._fit()
        if fit is None:  # one size seen: all of its time counted per token (an upper bound)
            return float(np.mean([t / k for k, t in self.history])) * n
        return fit[0] + fit[1] * n

    def target(self) -> int:
        """The chunk worth waiting for: per-call cost at most a quarter of the chunk's."""
        fit = self._fit()
        if fit is None:  # a second size, so the fit can tell per-call from per-token cost
            return 2 * self.history[-1][0] if self.history else MIN_CHUNK
        per_call, per_token = fit
        return max(MIN_CHUNK, math.ceil(3 * per_call / per_token))

    def tokens(self, remaining: int) -> int:
        """How many of the `remaining` tokens to translate now (0: not yet)."""
        if remaining <= 0 or self.credit <= 0:
            return 0
        if not self.history:
            return min(remaining, MIN_CHUNK)  # the first chunk measures; its time is a debt
        if self.cost(min(remaining, self.target())) > self.credit:
            return 0
        lo, hi = min(remaining, self.target()), remaining  # the largest n the credit covers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cost(mid) <= self.credit else (lo, mid - 1)
        return lo

    def spent(self, n: int, seconds: float) -> None:
        """A chunk of n tokens took `seconds`."""
        self.credit -= seconds
        if n > 0:
            self.history.append((n, seconds))
