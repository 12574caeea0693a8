"""What the translated path keeps of what was read, by length: what reader "auto" weighs
besides time.

    retention(n) = kept(n) / right(n)
    right(n): stated facts and copies the large model gets right reading an n-token turn itself
    kept(n):  those of them it also gets right on the small path

counted by `kvlingo eval --task content` for one pair, forward translator and reader policy
(the large model's tail and recompute share). Each draw of tasks (data, seed, kinds) keeps its
counts per length, a re-run replacing them at the lengths it measured; draws pool, and a demo
translator's shipped counts (`weights/manifest.json`) pool with them. A length is measured
once `right(n) >= MIN_RIGHT`; `expected(n)` is piecewise linear in log n between measured
lengths and the nearest one's value outside them. Reader "auto" takes the small path only where
`expected(n) >= ReaderPolicy.min_retention`.

Stored in `<cache folder>/retention/<hash of the key>.json` (key: both models' weights, the
forward translator's fingerprint, `large_reads_last` and `recompute_share`). A file that does
not parse or whose counts are malformed is ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo._platform.cachedir import cache_root

SCHEMA = "mlx-kvlingo/retention-counts"
FOLDER = "retention"
MIN_RIGHT = 3  # fewer native answers than this would let one answer swing reader auto

Count = tuple[int, int, int]  # (read length, kept, right)


def pooled(*counts) -> tuple[Count, ...]:
    """Counts summed per read length, lengths increasing; ValueError on a malformed count."""
    by: dict[int, list[int]] = {}
    for group in counts:
        for c in group:
            try:
                n, kept, right = c
                if not all(type(x) is int for x in c) or not 0 <= kept <= right or n <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(f"not a (length, kept, right) count: {c!r:.60}") from None
            s = by.setdefault(n, [0, 0])
            s[0] += kept
            s[1] += right
    return tuple((n, k, r) for n, (k, r) in sorted(by.items()))


def counts_of(entry: object) -> tuple[Count, ...]:
    """The counts of a manifest entry ({"counts": [[read length, kept, right], ...]}); none
    where it is malformed."""
    try:
        return pooled(map(tuple, entry["counts"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return ()


@dataclass(frozen=True)
class Retention:
    """(read length, retention) points, lengths increasing; `source` says where they came from
    (a command, a commit)."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self):
        ns = [n for n, _ in self.points]
        ok = bool(ns) and ns == sorted(set(ns)) and all(n > 0 for n in ns)
        if not ok or not all(0.0 <= r <= 1.0 for _, r in self.points):
            raise ValueError(f"retention points must be increasing lengths > 0 with values in "
                             f"[0, 1] (got {self.points!r:.80})")  # fmt: skip

    @classmethod
    def from_counts(cls, counts, source: str = "") -> Retention | None:
        """The measured lengths of `counts` (pooled), or None where none is measured yet."""
        pts = tuple((n, kept / right) for n, kept, right in pooled(counts) if right >= MIN_RIGHT)
        return cls(pts, source) if pts else None

    def expected(self, n: int) -> float:
        """The retention expected at `n` read tokens."""
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if n <= n1:
                t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return r0 + t * (r1 - r0)
        return pts[-1][1]


def key(pair, forward, policy) -> dict:
    from mlx_kvlingo.conversation.rates_cache import _model, translator_fingerprint

    return {
        "source": _model(pair.source),
        "target": _model(pair.target),
        "forward": translator_fingerprint(forward),
        "large_reads_last": policy.large_reads_last,
        "recompute_share": policy.recompute_share,
    }


def digest(k: dict) -> str:
    return hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20] + ".json"


def path_for(k: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / FOLDER / digest(k)


def load(k: dict, cache_dir: str | os.PathLike | None = None) -> dict[str, tuple[Count, ...]]:
    """{draw: its counts} stored for key `k`; empty when there are none or the file does not
    parse."""
    try:
        data = json.loads(path_for(k, cache_dir).read_text())
        if data.get("schema") != SCHEMA or data.get("key") != json.loads(json.dumps(k)):
            return {}
        return {str(d): pooled(map(tuple, c)) for d, c in data["draws"].items()}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}


def record(k: dict, draw: str, counts, cache_dir=None) -> dict[str, tuple[Count, ...]]:
    """Store one run's counts for `k` under `draw` (what picked its tasks: data, seed, kinds),
    atomically, and return every draw's. A draw stored before keeps the lengths this run did
    not measure and takes this run's counts at the others: the same tasks are never counted
    twice. OSError when the cache folder cannot be written."""
    draws = load(k, cache_dir)
    mine = {c[0]: c for c in pooled(counts)}
    kept = [c for c in draws.get(draw, ()) if c[0] not in mine]
    draws[draw] = pooled(kept, mine.values())
    path = path_for(k, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {d: [list(c) for c in cs] for d, cs in draws.items()}
    data = {"schema": SCHEMA, "key": k, "draws": stored}
    write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return draws
