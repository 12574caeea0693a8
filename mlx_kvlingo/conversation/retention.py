"""What the small path keeps of a turn's content, by the turn's length: what reader "auto"
weighs beside time (reader.py), measured by `kvlingo eval --task content`.

Retention at read length n: of the stated facts and copies the large model gets right reading
the turn itself (right), those it also gets right on the small path (kept), pooled over draws:
kept / right where right >= `MIN_RIGHT`, linear in log n between measured lengths, the nearest
one's outside. Auto takes the small path only where it is at least `ReaderPolicy.min_retention`.
Stored in `<cache folder>/retention/` (rates.read, rates.write), keyed by `retention_key` (the
pair, the forward translator, the policy's tail and recompute share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlx_kvlingo.conversation.rates import fingerprints, read, write

MIN_RIGHT = 3  # fewer native answers right at a length would let one answer swing auto
RETENTION = "retention"  # the cache folder's subfolder


@dataclass(frozen=True)
class Retention:
    """(read length, retention in [0, 1]) points, lengths increasing; `source`: where they came
    from."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    @classmethod
    def from_counts(cls, counts, source: str = "") -> Retention | None:
        """The lengths of `counts` measured enough (pooled); None where none is."""
        pts = tuple((n, kept / right) for n, kept, right in pooled(counts) if right >= MIN_RIGHT)
        return cls(pts, source) if pts else None

    def expected(self, n: int) -> float:
        """The retention expected at `n` read tokens."""
        pts = self.points
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if n0 < n < n1:
                return r0 + math.log(n / n0) / math.log(n1 / n0) * (r1 - r0)
        return min(pts, key=lambda p: abs(p[0] - n))[1]


def pooled(*groups) -> tuple[tuple[int, int, int], ...]:
    """(read length, kept, right) counts summed per length, lengths increasing; ValueError on a
    malformed count."""
    by: dict[int, list[int]] = {}
    for c in (c for group in groups for c in group):
        ok = isinstance(c, (tuple, list)) and len(c) == 3 and all(type(x) is int for x in c)
        if not ok or not 0 <= c[1] <= c[2] or c[0] <= 0:
            raise ValueError(f"not a (length, kept, right) count: {c!r:.60}")
        s = by.setdefault(c[0], [0, 0])
        s[0], s[1] = s[0] + c[1], s[1] + c[2]
    return tuple((n, k, r) for n, (k, r) in sorted(by.items()))


def counts_of(entry: object) -> tuple[tuple[int, int, int], ...]:
    """A manifest entry's counts ({"counts": [[length, kept, right], ...]}); () if malformed."""
    try:
        return pooled(map(tuple, entry["counts"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return ()


def retention_key(pair, forward, policy) -> dict:
    return {"pair": fingerprints(pair, forward), "tail": policy.large_reads_last,
            "recompute_share": policy.recompute_share}  # fmt: skip


def load_retention(k: dict) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """{draw: its counts} stored for key `k`; empty where none parse."""
    try:
        return {str(d): pooled(map(tuple, c)) for d, c in read(RETENTION, k)["draws"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}


def record_retention(k: dict, draw: str, counts) -> dict:
    """Store one run's counts for `k` under `draw` (what picked its tasks) and return every
    draw's: a draw stored before keeps the lengths this run did not measure, so the same tasks
    never count twice. OSError where the cache folder cannot be written."""
    draws = load_retention(k)
    mine = {c[0]: c for c in pooled(counts)}
    draws[draw] = pooled([c for c in draws.get(draw, ()) if c[0] not in mine], mine.values())
    write(RETENTION, k, draws={d: [list(c) for c in cs] for d, cs in draws.items()})
    return draws
