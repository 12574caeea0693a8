"""Who reads a turn for the large model, decided once per turn (`choose`) from this pair's
measured read rates and the translator's measured retention.

Time. A read of n tokens by a model holding `at` costs a + b n + c n (at + n / 2) seconds, a
translation a + b n: each of the five costs (`NAMES`) is a nonnegative least-squares fit to its
last `KEEP` measurements, each weighing `DECAY` of the next:

    large reads   target_read(lacked, at=held)   (target_step for a single token)
    small reads   catch-up (backward(k), or the small reads it too) + source_read(read)
                  + forward(lacked - tail) + target_read(recompute + 2 tail, at the turn's
                  end) + target_step (target_step alone for a one-token tail, no recompute)

Content. Retention at read length n: of what the large model gets right reading the turn itself
(right), what it also gets right on the small path (kept), pooled: kept / right where right >=
`MIN_RIGHT`, linear in log n between measured lengths, the nearest one's outside.

The choice. Reader "auto" takes the small path where its predicted TTFT beats the large's own
read by more than READER_MARGIN (a tie, or no timing yet: the token rule) and its retention is at
least `min_retention`; the recompute, then the tail, are dropped where they would take it past
TAIL_BUDGET x the plain handoff's TTFT and TAIL_ALLOWANCE_S more. Files: `<cache folder>/<folder>/
<hash of the key>.json`, written atomically; one whose schema or key differs is ignored.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_kvlingo._platform import blas
from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo._platform.cachedir import cache_root
from mlx_kvlingo.conversation.stream import TurnStats, share
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.recompute import Selection, large_reads
from mlx_kvlingo.models.pair import model_fingerprint

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DECAY, KEEP = 0.7, 12
NAMES = ("source_read", "forward", "backward", "target_read", "target_step")
SCHEMA = "mlx-kvlingo/rates-3"
RATES, RETENTION = "rates", "retention"  # the cache folder's subfolders
PROBE = (16, 64)  # tokens a never-timed large model reads once each, to time it
MIN_RIGHT = 3
TAIL_BUDGET, TAIL_ALLOWANCE_S = 2.0, 0.5
READER_MARGIN = 0.05
#: each attention peak with the rest of its sentence (weights/QUALITY.md)
RECOMPUTE_SELECTION = Selection()


@dataclass
class Cost:
    """seconds = a + b n + c n (at + n / 2) over recent (n, seconds, at); c = 0 without
    `attention`; `frozen`: ignores measurements (exact costs a test injects)."""

    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    frozen: bool = False
    attention: bool = True

    def observe(self, n: int, seconds: float, at: int = 0, again: bool = False) -> None:
        """`again`: replaces the samples of the same (n, at) (a probe a later start repeats)."""
        if n > 0 and seconds > 0 and at >= 0 and not self.frozen:
            if again:
                self.samples = deque([x for x in self.samples if (x[0], x[2]) != (n, at)], KEEP)
            self.samples.append((int(n), float(seconds), int(at)))

    @property
    def ready(self) -> bool:  # an intercept and a slope
        return len({n for n, _, _ in self.samples}) >= 2

    def features(self, n: int, at: int = 0) -> tuple[float, ...]:
        return (1.0, float(n), n * (at + n / 2))[: 3 if self.attention else 2]

    def fit(self) -> tuple[float, ...] | None:
        """(a, b, c) (without attention (a, b)), each >= 0: of the subsets of terms whose
        weighted least squares are all >= 0, the smallest error (b always fitted)."""
        if not self.samples:
            return None
        k, m = len(self.samples), 3 if self.attention else 2
        w = np.sqrt([DECAY ** (k - 1 - i) for i in range(k)])[:, None]
        X = np.array([self.features(n, at) for n, _, at in self.samples]) * w
        y = np.array([s for _, s, _ in self.samples]) * w[:, 0]
        best, err = {}, math.inf
        for terms in (t for t in ([0, 1, 2], [0, 1], [1, 2], [1]) if max(t) < m):
            coef = np.linalg.lstsq(X[:, terms], y, rcond=None)[0]
            e = float(np.sum((X[:, terms] @ coef - y) ** 2))
            ok = np.linalg.matrix_rank(X[:, terms]) == len(terms) and min(coef) >= 0
            if ok and e < err - 1e-15:
                best, err = dict(zip(terms, coef.tolist())), e
        return tuple(best.get(i, 0.0) for i in range(m))

    def predict(self, n: int, at: int = 0) -> float | None:
        coef = self.fit() if n > 0 else ()
        return None if coef is None else float(np.dot(coef, self.features(n, at)[: len(coef)]))


@dataclass
class ReadCosts:
    """The five costs of one pair in this process; how long the last warm-up took and whether
    its rates were "measured" or "cached" (warmup.py)."""

    source_read: Cost = field(default_factory=Cost)
    forward: Cost = field(default_factory=lambda: Cost(attention=False))
    backward: Cost = field(default_factory=lambda: Cost(attention=False))
    target_read: Cost = field(default_factory=Cost)
    target_step: Cost = field(default_factory=lambda: Cost(attention=False))
    warmup_s: float | None = None
    origin: str | None = None

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {name: [list(x) for x in getattr(self, name).samples] for name in NAMES}

    @classmethod
    def from_dict(cls, data: object) -> ReadCosts:
        """ValueError unless `data` is `to_dict`'s."""
        out = cls()
        if not isinstance(data, dict) or set(data) != set(NAMES):
            raise ValueError(f"expected the costs {', '.join(NAMES)}")
        for name in NAMES:
            for n, s, at in data[name] if len(data[name]) <= KEEP else [()]:
                ok = type(n) is type(at) is int and n > 0 <= at and type(s) in (int, float)
                if not ok or not 0 < s < math.inf:
                    raise ValueError(f"{name}: not positive [tokens, seconds, at]")
                getattr(out, name).samples.append((n, float(s), at))
        return out

    def observe_target(self, n: int, seconds: float, at: int = 0) -> None:
        (self.target_step if n == 1 else self.target_read).observe(n, seconds, 0 if n == 1 else at)

    def large_reads(self, lacked: int, at: int = 0) -> float | None:
        if lacked == 1:
            return self.target_step.predict(1) if self.target_step.samples else None
        return self.target_read.predict(lacked, at) if self.target_read.ready else None


@dataclass(frozen=True)
class Paths:
    """A large answer about to start: the lengths each way of reading its turn involves (the
    module docstring's formulas; None where a cost they need is unmeasured)."""

    lacked: int  # tokens the large model lacks
    catch_up: int  # tokens the small model must first catch up on (the large's answers)
    read: int  # tokens the small model then reads itself
    backward: bool  # the small catches up by backward translation (else it reads them too)
    tail: int = 1  # on the small path, the last tokens the large model still reads itself
    recompute: int = 0  # on the small path, translated tokens the large model recomputes
    held: int = 0  # tokens the large model holds
    small_held: int = 0

    def large(self, costs: ReadCosts) -> float | None:
        return costs.large_reads(self.lacked, self.held)

    def small(self, costs: ReadCosts) -> float | None:
        c, back = costs, bool(self.catch_up and self.backward)
        if not (c.source_read.ready and c.forward.ready and (c.backward.ready or not back)):
            return None
        at = self.held + self.lacked - self.recompute - self.tail  # the large model's last read
        large = c.large_reads(large_reads(self.tail, self.recompute), at)
        step = c.large_reads(1) if self.recompute else 0.0
        if large is None or step is None:
            return None
        k = 0 if back else self.catch_up  # of the large's answers, what the small reads itself
        small = c.source_read.predict(self.read + k, self.small_held + self.catch_up - k)
        small += c.backward.predict(self.catch_up) if back else 0.0
        return small + c.forward.predict(self.lacked - self.tail) + large + step


def costs_of(pair) -> ReadCosts:
    return pair.__dict__.setdefault("_kvlingo_read_costs", ReadCosts())


@dataclass(frozen=True)
class Retention:
    """(read length, retention) points, lengths increasing; `source`: where they came from."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    @classmethod
    def from_counts(cls, counts, source: str = "") -> Retention | None:
        pts = tuple((n, kept / right) for n, kept, right in pooled(counts) if right >= MIN_RIGHT)
        return cls(pts, source) if pts else None

    def expected(self, n: int) -> float:
        pts = self.points
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if n0 < n < n1:
                return r0 + math.log(n / n0) / math.log(n1 / n0) * (r1 - r0)
        return min(pts, key=lambda p: abs(p[0] - n))[1]


def pooled(*groups) -> tuple[tuple[int, int, int], ...]:
    """(read length, kept, right) counts summed per length, lengths increasing."""
    by: dict[int, list[int]] = {}
    for c in (c for group in groups for c in group):
        ok = isinstance(c, (tuple, list)) and len(c) == 3 and all(type(x) is int for x in c)
        if not ok or not 0 <= c[1] <= c[2] or c[0] <= 0:
            raise ValueError(f"not a (length, kept, right) count: {c!r:.60}")
        s = by.setdefault(c[0], [0, 0])
        s[0], s[1] = s[0] + c[1], s[1] + c[2]
    return tuple((n, k, r) for n, (k, r) in sorted(by.items()))


def counts_of(entry: object) -> tuple[tuple[int, int, int], ...]:
    """A manifest entry's counts ({"counts": [[length, kept, right], ...]})."""
    try:
        return pooled(map(tuple, entry["counts"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return ()


def load_retention(k: dict) -> dict[str, tuple[tuple[int, int, int], ...]]:
    try:
        return {str(d): pooled(map(tuple, c)) for d, c in read(RETENTION, k)["draws"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}


def record_retention(k: dict, draw: str, counts) -> dict:
    """Store `counts` as draw `draw`'s for key `k` and return every draw's: a draw stored before
    keeps the lengths this run did not measure, so the same tasks never count twice."""
    draws = load_retention(k)
    mine = {c[0]: c for c in pooled(counts)}
    draws[draw] = pooled([c for c in draws.get(draw, ()) if c[0] not in mine], mine.values())
    write(RETENTION, k, draws={d: [list(c) for c in cs] for d, cs in draws.items()})
    return draws


def fingerprints(pair, *translators) -> list[str | None]:
    def translator(tr) -> str:
        h = hashlib.sha256(f"{type(tr).__name__} {replace(tr.config, metadata={})!r}".encode())
        for name, w in sorted(tree_flatten(tr.parameters())):
            h.update(f"{name}:{tuple(w.shape)}:{w.dtype}".encode())
            h.update(np.array(w.reshape(-1)[:256].astype(mx.float32)).tobytes())
        return h.hexdigest()[:16]

    models = [f"{model_fingerprint(m)} {m.dtype} {m.config.get('model_type')} "
              f"{m.config.get('quantization')}" for m in (pair.source, pair.target)]  # fmt: skip
    return models + [None if t is None else translator(t) for t in translators]


def rates_key(pair, forward, backward, lengths) -> dict:
    info = mx.device_info()  # its chip (on Linux the CPU's model name) and memory
    env = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "KVLINGO_CPU_MEMORY")
    machine = [platform.platform(), os.cpu_count(), str(mx.default_device()), blas.loaded_path,
               *(str(info.get(k)) for k in ("device_name", "memory_size")),
               *map(os.environ.get, env)]  # fmt: skip
    ours = getattr(sys.modules.get("mlx_kvlingo"), "__version__", None)  # a checkout's own
    versions = [importlib.metadata.version(d) for d in ("mlx", "mlx-lm")] + [ours]
    return {"machine": machine, "pair": fingerprints(pair, forward, backward), "versions": versions,
            "lengths": [int(n) for n in lengths]}  # fmt: skip


def retention_key(pair, forward, policy) -> dict:
    return {"pair": fingerprints(pair, forward), "tail": policy.large_reads_last,
            "recompute_share": policy.recompute_share}  # fmt: skip


def path_for(folder: str | Path, k: dict) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / folder / f"{digest}.json"


def read(folder, k: dict) -> dict:
    try:
        data = json.loads(path_for(folder, k).read_text())
        same = data.get("schema") == SCHEMA and data.get("key") == json.loads(json.dumps(k))
        return data if same else {}
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not a dict
        return {}


def write(folder, k: dict, **data) -> Path:
    path = path_for(folder, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": SCHEMA, "key": k, **data}, indent=1, sort_keys=True)
    return write_text(path, text + "\n")


@dataclass(frozen=True)
class Decision:
    """One turn's reading, decided once by `choose` and carried through the hand-off."""

    small: bool = False  # the small model reads conversation[:cut] for the large one
    note: str = ""  # why the large reads itself (or reads less), for the status line
    paths: Paths | None = None  # the lengths of both ways (None: no prediction applies)
    cut: int = 0  # where the small model's reading stops (`small` only)
    recompute: bool = False  # the large recomputes `recompute_share` of the translated span
    retention: float | None = None  # the measured retention that turned the small path down


def choose(s, name: str, upto: int) -> Decision:
    """Does the small model read [large's held, upto) for `name` this turn in session `s`,
    where does it stop, and does the large recompute? Changes nothing."""
    if name != "target" or s.forward is None or s.mode == "reprefill":
        return Decision()
    p, (tail, recompute) = s.policy, _reading(s, upto)
    paths = paths_with(s, upto, tail, recompute) if s.mode == "alternation" else None
    held = min(s.models["target"].held, upto)
    cut = max(held, upto + 1 - tail)
    if cut <= s.models["target"].held:  # one way only
        why = f"the turn is within the {p.large_reads_last} tok the large reads itself"
        return Decision(note="" if p.reader == "self" else why)
    small, why, kept = _rule(s, upto, paths)
    count = recompute_count(s, cut - held)  # 0 unless alternation
    over = f"would take over {TAIL_BUDGET:g}x this TTFT and {TAIL_ALLOWANCE_S:g} s more"
    if small and p.large_reads_last > 1 and tail == 1:
        why = f"the large reads the last token only: reading the last {p.large_reads_last} tok"
        why += f" {over}"
    elif small and count and not recompute:
        why = f"no recompute: recomputing {p.recompute_share:.0%} of the turn {over}"
    return Decision(small, why, paths, cut if small else 0, small and recompute and count > 0, kept)


def _rule(s, upto: int, paths: Paths | None) -> tuple[bool, str, float | None]:
    """(the small model reads, why the large reads itself, the retention that turned the small
    path down)."""
    p = s.policy
    if p.reader in ("small", "self"):
        return p.reader == "small", "", None
    held = s.models["target"].held
    rule = held == 0 or upto - held >= p.reader_min_tokens
    under = f"the large reads turns under {p.reader_min_tokens} tok"
    if p.reader == "tokens":
        return rule, "" if rule else f"reader tokens: {under}", None
    large = None if paths is None else paths.large(s.read_costs)
    small = None if paths is None else paths.small(s.read_costs)
    if large is None or small is None or abs(large - small) <= READER_MARGIN * min(large, small):
        how = "not timed yet" if large is None or small is None else "a tie"
        small_reads, why = rule, "" if rule else f"reader auto, {how}: {under}"
    else:
        small_reads, why = small < large, "" if small < large else "reader auto: the faster"
    r = s.retention
    kept = None if r is None or not p.min_retention else r.expected(upto + 1 - held)
    if small_reads and kept is not None and kept < p.min_retention:
        return False, (f"reader auto: the small path keeps ≈{share(kept)} of the content at "
                       f"{upto + 1 - held:,} tok, under {p.min_retention:g}"), kept  # fmt: skip
    return small_reads, why, None


def _reading(s, upto: int) -> tuple[int, bool]:
    """(the last tokens the large model reads itself, whether it recomputes), the first of the
    policy's, without the recompute, one token, within the tail budget."""
    k, share = s.policy.large_reads_last, s.policy.recompute_share > 0
    ways = [(k, share), *([(k, False)] if share else []), *([(1, False)] if k > 1 else [])]
    if len(ways) == 1 or s.mode != "alternation":
        return ways[0]
    a = paths_with(s, upto, 1, False).small(s.read_costs)
    if a is None:
        return ways[0]
    limit = max(TAIL_BUDGET * a, a + TAIL_ALLOWANCE_S)
    for tail, recompute in ways:
        b = paths_with(s, upto, tail, recompute).small(s.read_costs)
        if b is None or b <= limit:
            return tail, recompute
    return 1, False


def paths_with(s, upto: int, tail: int, recompute: bool = True) -> Paths:
    th, sh = min(s.models["target"].held, upto), min(s.models["source"].held, upto)
    cut = max(th, upto + 1 - tail)
    return Paths(upto + 1 - th, max(th - sh, 0), max(cut - max(sh, th), 0),
                 s.backward is not None, upto + 1 - cut,
                 recompute_count(s, cut - th) if recompute else 0, th, sh)  # fmt: skip


def recompute_count(s, translated: int) -> int:
    """How many of `translated` tokens the large model recomputes (alternation only)."""
    share = s.policy.recompute_share if s.mode == "alternation" else 0.0
    return RECOMPUTE_SELECTION.count(share, translated) if share else 0


def observe(s, stats: TurnStats, at: int) -> None:
    """Feed what a turn measured into the read costs; the answering model read over `at`."""
    costs, rd, sw = s.read_costs, stats.read, stats.switch
    if rd is not None:
        costs.source_read.observe(rd.tokens, rd.seconds, rd.start)
    for x in (rd and rd.catch_up, sw):  # each translation (a naive one's length is not its own)
        if x is not None and x.translated and not x.retranslated:
            cost = costs.forward if x.into == "target" else costs.backward
            cost.observe(x.translated, x.seconds)
    if sw is not None and sw.recompute_s:
        n = large_reads(sw.tail_read, sw.recomputed)
        costs.target_read.observe(n, sw.recompute_s, max(sw.end - sw.recomputed, 0))
    if stats.model == "target":
        costs.observe_target(stats.prompt_tokens, stats.prompt_s, at)


def alternative(s, stats: TurnStats, paths: Paths, conversation: list[int]) -> None:
    """The TTFT the other way of reading would have had, predicted from the rates this turn
    updated; the large model's own read is timed once (after the answer, on `PROBE` tokens of
    the conversation) when it never was."""
    costs = s.read_costs
    if stats.read is None:
        stats.alternative_ttft_s = paths.small(costs)
        return
    for n in PROBE if not costs.target_read.ready else ():
        probe = (conversation * (n // max(len(conversation), 1) + 1))[:n]
        costs.target_read.observe(n, timed_read(s.pair.target, probe))
    stats.alternative_ttft_s = paths.large(costs)


def timed_read(loaded, ids: list[int], at: int = 0) -> float:
    """Seconds `loaded` takes to read `ids` over `at` zero positions in a scratch cache (the
    attention costs the same whatever the K/V hold)."""
    cache, g = new_cache(loaded), loaded.geometry
    if at:
        k = mx.zeros((1, g.kv_heads, at, g.head_dim), dtype=loaded.dtype)
        v = mx.zeros((1, g.kv_heads, at, g.value_dim), dtype=loaded.dtype)
        append_kv(cache, [k] * len(cache), [v] * len(cache))
        mx.eval([c.state for c in cache])
    t0 = time.perf_counter()
    mx.eval(loaded.model(mx.array(ids)[None], cache=cache))
    return time.perf_counter() - t0
