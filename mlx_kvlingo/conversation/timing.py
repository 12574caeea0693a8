"""What reading costs on this pair, in this process: the rates behind reader "auto".

Each cost is seconds = a + b * n for n tokens, fitted on the latest measurements (weights
decay by `DECAY` per newer one, so the rates follow the machine as it warms up or gets busy):

    source_read(n)  the small model's prefill of n tokens (reading for the large one)
    forward(n)      translating n tokens small -> large (capture, map, append)
    backward(n)     translating n tokens large -> small (the small catching up on an answer)
    target_read(n)  the large model's own read of n >= 2 tokens up to its first token, as
                    mlx-lm times it (its prefill plus its first step)
    target_step     the same for one token (after a translation): a cost of its own, since
                    one token may take another code path (an MoE's per-expert prefill loop
                    costs about the same for 2 tokens as for 100, and is not run for one)

The two ways a large answer can start, predicted with the same accounting as they are measured:

    large reads     target_read(lacked)
    small reads     catch-up (backward(k), or source_read when there is no backward map)
                    + source_read(read) + forward(lacked - tail) + the large reading the
                    tail itself (target_step for one token, else target_read(tail))

Measurements come from a warm-up at load (`warmup.py`: a scripted scratch conversation, which
also pays once what a process pays on its first turn: compiled kernels, lazy weights, first
allocations, the chat template) and from every real turn. The warm-up's measurements are kept
in the cache folder (`rates_cache.py`; `to_dict` / `from_dict`), so a later start on the same
machine, pair and library versions reuses them instead of measuring again. The costs are
shared by the pair's conversations (`costs_of(pair)`); a session may be handed its own (tests
inject exact ones).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.7  # weight of a measurement relative to the next newer one
KEEP = 12  # measurements kept per cost
NAMES = ("source_read", "forward", "backward", "target_read", "target_step")


@dataclass
class Cost:
    """seconds = a + b * n, least squares over recent (n, seconds), newer ones weigh more."""

    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    frozen: bool = False  # ignores new measurements (an injected, exact cost)

    def observe(self, n: int, seconds: float) -> None:
        if n > 0 and seconds > 0 and not self.frozen:
            self.samples.append((int(n), float(seconds)))

    @property
    def ready(self) -> bool:
        """Measured at two lengths at least (an intercept and a slope)."""
        return len({n for n, _ in self.samples}) >= 2

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; None before any measurement. With one length only, a = 0."""
        if not self.samples:
            return None
        k = len(self.samples)
        w = [DECAY ** (k - 1 - i) for i in range(k)]
        sw = sum(w)
        mn = sum(wi * n for wi, (n, _) in zip(w, self.samples)) / sw
        ms = sum(wi * s for wi, (_, s) in zip(w, self.samples)) / sw
        var = sum(wi * (n - mn) ** 2 for wi, (n, _) in zip(w, self.samples))
        if var == 0:
            return 0.0, ms / mn
        cov = sum(wi * (n - mn) * (s - ms) for wi, (n, s) in zip(w, self.samples))
        b = max(cov / var, 0.0)
        a = ms - b * mn
        if a < 0:  # through the origin instead
            a, b = 0.0, ms / mn
        return a, b

    def predict(self, n: int) -> float | None:
        if n <= 0:
            return 0.0
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * n


@dataclass
class ReadCosts:
    """The four costs of one pair in this process (see the module docstring)."""

    source_read: Cost = field(default_factory=Cost)
    forward: Cost = field(default_factory=Cost)
    backward: Cost = field(default_factory=Cost)
    target_read: Cost = field(default_factory=Cost)
    target_step: Cost = field(default_factory=Cost)
    warmup_s: float | None = None  # how long the warm-up took (None: none ran)
    #: where the rates came from: "measured" by this process's warm-up, "cached" (reused from
    #: the cache folder, measured by an earlier start), None (no warm-up ran)
    origin: str | None = None

    @classmethod
    def fixed(cls, **rates: tuple[float, float]) -> ReadCosts:
        """Exact costs that no measurement changes, from (a, b) per name, e.g.
        `fixed(target_read=(0.02, 0.005), ...)`; the names not given stay unmeasured, but
        `target_step` defaults to target_read(1)."""
        out = cls()
        if "target_read" in rates and "target_step" not in rates:
            rates = {**rates, "target_step": rates["target_read"]}
        for name in NAMES:
            cost = getattr(out, name)
            if name in rates:
                a, b = rates[name]
                cost.samples.extend([(1, a + b), (1001, a + 1001 * b)])
            cost.frozen = True
        return out

    def to_dict(self) -> dict[str, list[list[float]]]:
        """The measurements, {name: [[n, seconds], ...]} oldest first (what `from_dict` takes)."""
        return {name: [[n, s] for n, s in getattr(self, name).samples] for name in NAMES}

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

    def observe_target(self, n: int, seconds: float) -> None:
        """The large model read n tokens itself, up to its first token, in `seconds`."""
        (self.target_step if n == 1 else self.target_read).observe(n, seconds)

    def step(self) -> float | None:
        """The large model's read of one token (its first step after a translation)."""
        return self.target_step.predict(1) if self.target_step.samples else None

    def large_reads(self, lacked: int) -> float | None:
        """Predicted TTFT with the large model reading the `lacked` tokens itself."""
        if lacked == 1:
            return self.step()
        return self.target_read.predict(lacked) if self.target_read.ready else None

    def small_reads(
        self, lacked: int, catch_up: int, read: int, backward: bool, tail: int = 1,
        recompute: int = 0,
    ) -> float | None:  # fmt: skip
        """Predicted TTFT with the small model reading: it catches up on `catch_up` tokens
        (translated back when `backward`, else it reads them), reads `read` tokens, `lacked -
        tail` are translated into the large model, which reads the last `tail` itself and
        recomputes `recompute` of the translated ones (about a read of `recompute + tail`,
        then one step: the answer reads the last token again over the recomputed ones)."""
        needed = [self.source_read, self.forward]
        if catch_up and backward:
            needed.append(self.backward)
        if not all(c.ready for c in needed):
            return None
        large = self.large_reads(recompute + tail)
        step = self.step() if recompute else 0.0
        if large is None or step is None:
            return None
        large += step
        if catch_up and backward:
            t = self.backward.predict(catch_up) + (self.source_read.predict(read) if read else 0.0)
        else:
            t = self.source_read.predict(catch_up + read) if catch_up + read else 0.0
        return t + (self.forward.predict(lacked - tail) if lacked > tail else 0.0) + large


def _sample(name: str, x: object) -> tuple[int, float]:
    try:
        n, s = x  # type: ignore[misc]
        ok = all(type(v) in (int, float) for v in (n, s)) and n == int(n) > 0 and 0 < s < math.inf
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or not isinstance(x, list):
        raise ValueError(f"{name}: {x!r:.40} is not a positive [tokens, seconds]")
    return int(n), float(s)


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

    def large(self, costs: ReadCosts) -> float | None:
        return costs.large_reads(self.lacked)

    def small(self, costs: ReadCosts) -> float | None:
        return costs.small_reads(self.lacked, self.catch_up, self.read, self.backward, self.tail,
                                 self.recompute)  # fmt: skip
