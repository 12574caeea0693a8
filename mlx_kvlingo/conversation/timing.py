"""What reading costs on this pair, in this process: the rates behind reader "auto".

A read of n tokens by a model whose cache already holds `at` tokens costs

    seconds = a + b * n + c * n * (at + n / 2)

(a per-call overhead, the per-token layers, and attention: each of the n tokens attends to the
`at` before it and to about half of the n), fitted on the latest measurements (weights decay by
`DECAY` per newer one, so the rates follow the machine as it warms up or gets busy). A
translation costs a + b * n (c = 0: every token is mapped on its own). Without the attention
term, rates measured on short turns predicted a 2,000-token read at 0.4 of what it took.

    source_read(n, at)  the small model's prefill of n tokens (reading for the large one)
    forward(n)          translating n tokens small -> large (capture, map, append)
    backward(n)         translating n tokens large -> small (the small catching up on an answer)
    target_read(n, at)  the large model's own read of n >= 2 tokens up to its first token, as
                        mlx-lm times it (its prefill plus its first step)
    target_step         the same for one token (after a translation): a cost of its own, since
                        one token may take another code path (an MoE's per-expert prefill loop
                        costs about the same for 2 tokens as for 100, and is not run for one)

The two ways a large answer can start, predicted with the same accounting as they are measured:

    large reads     target_read(lacked, at=held)
    small reads     catch-up (backward(k), or source_read when there is no backward map)
                    + source_read(read) + forward(lacked - tail) + the large reading the
                    tail, recomputing and reading the tail again (target_read(recompute +
                    2 * tail) at the turn's end, then target_step; target_step alone for a
                    one-token tail)

Measurements come from a warm-up at load (`warmup.py`: a scripted scratch conversation, which
also pays once what a process pays on its first turn: compiled kernels, lazy weights, first
allocations, the chat template; and each model reads a few tokens over a long scratch cache,
which gives the attention term) and from every real turn. The warm-up's measurements are kept
in the cache folder (`rates_cache.py`; `to_dict` / `from_dict`), so a later start on the same
machine, pair and library versions reuses them instead of measuring again. The costs are
shared by the pair's conversations (`costs_of(pair)`); a session may be handed its own (tests
inject exact ones).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from mlx_kvlingo.kv.recompute import large_reads

import numpy as np

DECAY = 0.7  # weight of a measurement relative to the next newer one
KEEP = 12  # measurements kept per cost
NAMES = ("source_read", "forward", "backward", "target_read", "target_step")


@dataclass
class Cost:
    """seconds = a + b * n + c * n * (at + n / 2), weighted least squares over recent
    (n, seconds, at), newer ones weigh more; a, b, c >= 0. `attention=False`: c = 0."""

    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    frozen: bool = False  # ignores new measurements (an injected, exact cost)
    attention: bool = True

    def observe(self, n: int, seconds: float, at: int = 0) -> None:
        if n > 0 and seconds > 0 and at >= 0 and not self.frozen:
            self.samples.append((int(n), float(seconds), int(at)))

    def remeasure(self, n: int, seconds: float, at: int = 0) -> None:
        """The same read measured again: it replaces every sample of the same (n, at) and is
        the newest."""
        if n > 0 and seconds > 0 and at >= 0 and not self.frozen:
            kept = [x for x in self.samples if (x[0], x[2]) != (n, at)]
            self.samples = deque([*kept, (int(n), float(seconds), int(at))], KEEP)

    @property
    def ready(self) -> bool:
        """Measured at two lengths at least (an intercept and a slope)."""
        return len({n for n, _, _ in self.samples}) >= 2

    def features(self, n: int, at: int = 0) -> tuple[float, ...]:
        """(1, n, n * (at + n / 2)): what a, b and c multiply (without c: the first two)."""
        return (1.0, float(n), n * (at + n / 2))[: 3 if self.attention else 2]

    def fit(self) -> tuple[float, ...] | None:
        """(a, b, c) (without attention: (a, b)), each >= 0; None before any measurement. Of
        the fits whose least-squares coefficients are all >= 0 it keeps the one with the
        smallest error (b is always fitted; with one length only: b alone, through 0)."""
        if not self.samples:
            return None
        k, m = len(self.samples), 3 if self.attention else 2
        w = np.sqrt([DECAY ** (k - 1 - i) for i in range(k)])
        X = np.array([self.features(n, at) for n, _, at in self.samples])
        y = np.array([s for _, s, _ in self.samples])
        best, err = None, math.inf
        for terms in ([0, 1, 2], [0, 1], [1, 2], [1]):
            if max(terms) >= m:
                continue
            A = X[:, terms] * w[:, None]
            coef = np.linalg.lstsq(A, y * w, rcond=None)[0]
            if np.linalg.matrix_rank(A) < len(terms) or (coef < 0).any():
                continue
            e = float(np.sum((A @ coef - y * w) ** 2))
            if e < err - 1e-15:
                best, err = dict(zip(terms, coef.tolist())), e
        if best is None:  # a rate through the origin
            best = {1: float(np.sum(w * w * y) / np.sum(w * w * X[:, 1]))}
        return tuple(best.get(i, 0.0) for i in range(m))

    def predict(self, n: int, at: int = 0) -> float | None:
        """Seconds for reading `n` tokens over `at` held (None before any measurement)."""
        if n <= 0:
            return 0.0
        coef = self.fit()
        return None if coef is None else float(np.dot(coef, self.features(n, at)))


@dataclass
class ReadCosts:
    """The four costs of one pair in this process (see the module docstring)."""

    source_read: Cost = field(default_factory=Cost)
    forward: Cost = field(default_factory=lambda: Cost(attention=False))
    backward: Cost = field(default_factory=lambda: Cost(attention=False))
    target_read: Cost = field(default_factory=Cost)
    target_step: Cost = field(default_factory=lambda: Cost(attention=False))
    warmup_s: float | None = None  # how long the warm-up took (None: none ran)
    #: where the rates came from: "measured" by this process's warm-up, "cached" (reused from
    #: the cache folder, measured by an earlier start), None (no warm-up ran)
    origin: str | None = None
    #: what a reusing start scaled the stored rates by (`warmup.check_load`); 1.0: as stored
    load_factor: float = 1.0

    @classmethod
    def fixed(cls, **rates: tuple[float, ...]) -> ReadCosts:
        """Exact costs that no measurement changes, from (a, b) or (a, b, c) per name, e.g.
        `fixed(target_read=(0.02, 0.005), ...)`; the names not given stay unmeasured, but
        `target_step` defaults to target_read(1)."""
        out = cls()
        if "target_read" in rates and "target_step" not in rates:
            a, b, *c = rates["target_read"]
            rates = {**rates, "target_step": (a + b + sum(c) / 2, 0.0)}
        for name in NAMES:
            cost = getattr(out, name)
            if name in rates:
                a, b, c = (*rates[name], 0.0)[:3]
                if c and not cost.attention:
                    raise ValueError(f"{name} has no attention term")
                points = [(1, 0), (1001, 0), (1, 4000)][: 3 if cost.attention else 2]
                cost.samples.extend((n, a + b * n + c * n * (at + n / 2), at) for n, at in points)
            cost.frozen = True
        return out

    def scale(self, factor: float) -> None:
        """Every measured second times `factor` (> 0): the same reads on a machine that many
        times slower. Exact (frozen) costs stay."""
        if not 0 < factor < math.inf:
            raise ValueError(f"a scale factor must be positive and finite (got {factor})")
        for name in NAMES:
            cost = getattr(self, name)
            if not cost.frozen:
                cost.samples = deque(((n, s * factor, at) for n, s, at in cost.samples), KEEP)

    def to_dict(self) -> dict[str, list[list[float]]]:
        """The measurements, {name: [[n, seconds, at], ...]} oldest first (what `from_dict`
        takes)."""
        return {name: [list(x) for x in getattr(self, name).samples] for name in NAMES}

    def load(self, data: object) -> None:
        """Replace the measurements with those of `to_dict`'s output. ValueError when `data`
        is not that (a name missing or unknown, a sample not a positive (n, seconds)); then
        nothing is replaced."""
        if not isinstance(data, dict) or set(data) != set(NAMES):
            raise ValueError(f"expected the costs {', '.join(NAMES)}")
        parsed = {}
        for name in NAMES:
            samples = data[name]
            if not isinstance(samples, list) or len(samples) > KEEP:
                raise ValueError(f"{name}: expected a list of at most {KEEP} samples")
            parsed[name] = [_sample(name, x) for x in samples]
        for name, samples in parsed.items():
            cost = getattr(self, name)
            cost.samples.clear()
            cost.samples.extend(samples)

    @classmethod
    def from_dict(cls, data: object) -> ReadCosts:
        out = cls()
        out.load(data)
        return out

    def observe_target(self, n: int, seconds: float, at: int = 0) -> None:
        """The large model read n tokens itself over `at` it held, up to its first token, in
        `seconds`."""
        if n == 1:
            self.target_step.observe(1, seconds)
        else:
            self.target_read.observe(n, seconds, at)

    def step(self) -> float | None:
        """The large model's read of one token (its first step after a translation)."""
        return self.target_step.predict(1) if self.target_step.samples else None

    def large_reads(self, lacked: int, at: int = 0) -> float | None:
        """Predicted TTFT with the large model reading the `lacked` tokens itself over the
        `at` it holds."""
        if lacked == 1:
            return self.step()
        return self.target_read.predict(lacked, at) if self.target_read.ready else None

    def small_reads(
        self, lacked: int, catch_up: int, read: int, backward: bool, tail: int = 1,
        recompute: int = 0, at: int = 0, small_at: int = 0,
    ) -> float | None:  # fmt: skip
        """Predicted TTFT with the small model reading: over the `small_at` tokens it holds it
        catches up on `catch_up` tokens (translated back when `backward`, else it reads them),
        reads `read` tokens, `lacked - tail` are translated into the large model (which held
        `at`), which reads the last `tail` itself, recomputes `recompute` of the translated
        ones and reads the tail again (about a read of `recompute + 2 * tail` at the turn's
        end, `recompute.large_reads`; then one step: the answer reads the last token)."""
        needed = [self.source_read, self.forward]
        if catch_up and backward:
            needed.append(self.backward)
        if not all(c.ready for c in needed):
            return None
        end = at + lacked
        large = self.large_reads(large_reads(tail, recompute), end - recompute - tail)
        step = self.step() if recompute else 0.0
        if large is None or step is None:
            return None
        large += step
        if catch_up and backward:
            t = self.backward.predict(catch_up)
            t += self.source_read.predict(read, small_at + catch_up) if read else 0.0
        else:
            t = self.source_read.predict(catch_up + read, small_at) if catch_up + read else 0.0
        return t + (self.forward.predict(lacked - tail) if lacked > tail else 0.0) + large


def _sample(name: str, x: object) -> tuple[int, float, int]:
    try:
        n, s, at = x  # type: ignore[misc]
        ok = all(type(v) in (int, float) for v in (n, s, at)) and n == int(n) > 0
        ok = ok and 0 < s < math.inf and at == int(at) >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or not isinstance(x, list):
        raise ValueError(f"{name}: {x!r:.40} is not a positive [tokens, seconds, at]")
    return int(n), float(s), int(at)


_ATTR = "_kvlingo_read_costs"


def costs_of(pair) -> ReadCosts:
    """The costs measured on `pair` in this process, shared by its conversations."""
    costs = pair.__dict__.get(_ATTR)
    if costs is None:
        costs = pair.__dict__[_ATTR] = ReadCosts()
    return costs


@dataclass(frozen=True)
class Paths:
    """A large answer about to start: the lengths each way of reading its turn involves."""

    lacked: int  # tokens the large model lacks (it reads them all, or the last `tail` only)
    catch_up: int  # tokens the small model must first catch up on (the large's answers)
    read: int  # tokens the small model then reads itself
    backward: bool  # the small catches up by backward translation (else it reads them too)
    tail: int = 1  # on the small path, the last tokens the large model still reads itself
    recompute: int = 0  # on the small path, translated tokens the large model recomputes
    held: int = 0  # tokens the large model holds (the turn starts there)
    small_held: int = 0  # tokens the small model holds

    def large(self, costs: ReadCosts) -> float | None:
        return costs.large_reads(self.lacked, self.held)

    def small(self, costs: ReadCosts) -> float | None:
        return costs.small_reads(self.lacked, self.catch_up, self.read, self.backward, self.tail,
                                 self.recompute, self.held, self.small_held)  # fmt: skip
