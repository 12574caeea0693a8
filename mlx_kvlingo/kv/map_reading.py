"""How a translator's batched maps read their source layers.

A map for target layer t multiplies the K/V of the nu source layers its row names by W_t.
The same products can be computed in more than one way, and which is fastest depends on
the shapes (how many source layers are read, how many target layers read each one, the
token count) and on the backend:

- `in_place`: `mx.gather_mm` reads each target layer's source layer where it lies; no copy
  of the source per target layer (MLX's CPU kernel: float32 only).
- `gathered`: the source layers are gathered per target layer first, then one batched
  matmul (on GPUs the copy is cheap and `gather_mm` is built for MoE routing).

Both read only the source layers some target layer uses: a mixing map needs a token's heads
side by side, which costs one copy of the source, and a translator into a shallower target
(28 source layers, 8 target layers) should not copy the 20 it never reads.

`MapReading` holds the rule (`RULE`) and, once `measure` has run (at load, in the warm-up,
or in `kvlingo bench`), the strategy measured fastest per map kind and token-count bucket.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx

STRATEGIES = ("in_place", "gathered")
#: token counts a measurement times; a span uses the one nearest in log scale. A 1024 bucket
#: would add ~2.5 s to the dense demo's 9 s warm-up, so longer spans rely on MARGIN below
BUCKETS = (64, 256)
#: the rule's strategy is kept unless another is faster by more than this share: two
#: strategies within noise of each other at 256 tokens were 1.6x apart at 1024
MARGIN = 0.10


def rule(dtype: mx.Dtype) -> str:
    """The strategy without a measurement: in place where MLX's kernel exists (CPU float32)."""
    return "in_place" if _in_place_applies(dtype) else "gathered"


def _in_place_applies(dtype: mx.Dtype) -> bool:
    return dtype == mx.float32 and mx.default_device() == mx.cpu


@dataclass(frozen=True)
class SourceRows:
    """The source layers a map reads (`used`, ascending) and its layer map re-indexed into
    them (`index`, (Lt, nu)); `everything` when all source layers are read in order."""

    used: mx.array
    index: mx.array
    everything: bool

    @classmethod
    def of(cls, rows: tuple[tuple[int, ...], ...], source_layers: int) -> SourceRows:
        used = sorted({s for r in rows for s in r})
        where = {s: i for i, s in enumerate(used)}
        return cls(
            mx.array(used),
            mx.array([[where[s] for s in r] for r in rows]),
            used == list(range(source_layers)),
        )

    def select(self, x: mx.array) -> mx.array:
        """x (Ls, ...) -> the used layers only (a view when all are used)."""
        return x if self.everything else x[self.used]


@dataclass
class MapReading:
    """The strategy per (kind, token count measured); empty until `measure` fills it (until
    then, and for a dtype the measured strategy cannot run in, the rule)."""

    chosen: dict[tuple[str, int], str] = field(default_factory=dict)
    #: seconds per strategy per (kind, bucket), from the last measurement (for reports)
    timings: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)

    def strategy(self, kind: str, n_tokens: int, dtype: mx.Dtype) -> str:
        measured = [n for k, n in self.chosen if k == kind]
        if not measured:
            return rule(dtype)
        nearest = min(measured, key=lambda n: abs(math.log(max(n_tokens, 1) / n)))
        got = self.chosen[(kind, nearest)]
        return got if got != "in_place" or _in_place_applies(dtype) else "gathered"

    def to_dict(self) -> dict[str, str]:
        """The choices, {"key:64": "in_place", ...} (what `from_dict` takes; timings are not
        kept: they are for reports)."""
        return {f"{kind}:{n}": name for (kind, n), name in sorted(self.chosen.items())}

    @classmethod
    def from_dict(cls, data: object) -> MapReading:
        """ValueError unless `data` is what `to_dict` gives."""
        if not isinstance(data, dict):
            raise ValueError("expected {kind:tokens: strategy}")
        chosen = {}
        for k, name in data.items():
            kind, _, n = str(k).partition(":")
            if (
                kind not in ("key", "value")
                or not (n.isascii() and n.isdigit())
                or name not in STRATEGIES
            ):
                raise ValueError(f"not a map-reading choice: {k!r:.40}: {name!r:.40}")
            chosen[(kind, int(n))] = name
        return cls(chosen)


def product(rows: mx.array, index: mx.array, w: mx.array, strategy: str) -> mx.array:
    """rows[index] @ w, with w broadcast over index's shape, computed by `strategy`."""
    if strategy == "in_place" and _in_place_applies(rows.dtype):
        shape = mx.broadcast_shapes(index.shape, w.shape[:-2])
        w_index = mx.arange(math.prod(w.shape[:-2])).reshape(w.shape[:-2])
        return mx.gather_mm(
            rows,
            w,
            lhs_indices=mx.broadcast_to(index, shape),
            rhs_indices=mx.broadcast_to(w_index, shape),
        )
    return rows[index] @ w


def measure(translator, n_tokens=BUCKETS, rounds: int = 2) -> MapReading:
    """Time each strategy on random source K/V of the translator's shapes (batch 1) and keep
    the fastest per kind and token count in `translator.reading`. Returns that reading.
    A translator without per-layer weight maps (lowrank, other methods) keeps its own single
    path and gets an empty reading."""
    reading = MapReading()
    if "weight" not in getattr(translator, "key", {}):
        return reading
    s = translator.config.source
    dtype = translator.key["weight"].dtype
    for n in n_tokens:
        for kind, width in (("key", s.head_dim), ("value", s.value_dim)):
            x = mx.random.normal((s.layers, 1, s.kv_heads, n, width)).astype(dtype)
            mx.eval(x)
            times = {
                name: _best_time(translator, x, kind, MapReading({(kind, n): name}), rounds)
                for name in STRATEGIES
                if name != "in_place" or _in_place_applies(dtype)
            }
            reading.timings[(kind, n)] = times
            reading.chosen[(kind, n)] = pick(times, rule(dtype))
    translator.reading = reading
    return reading


def pick(times: dict[str, float], default: str) -> str:
    """The fastest strategy, but `default` unless the fastest beats it by more than MARGIN."""
    fastest = min(times, key=times.get)
    if default in times and times[fastest] > (1 - MARGIN) * times[default]:
        return default
    return fastest


def _best_time(translator, x: mx.array, kind: str, reading: MapReading, rounds: int) -> float:
    mx.eval(translator.map_features(x, kind, reading=reading))  # first call: allocations
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval(translator.map_features(x, kind, reading=reading))
        best = min(best, time.perf_counter() - t0)
    return best
