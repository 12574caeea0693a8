"""What the translated path keeps of what was read, by length: what reader "auto" weighs
besides time.

    retention(n) = stated facts and copies the large model gets right on the small path
                   / those it gets right reading the same n-token turn itself

measured by `kvlingo eval --task content` for one pair, forward translator and reader policy
(the large model's tail and recompute share) at a few read lengths. `expected(n)` is piecewise
linear in log n between the measured lengths and the nearest one's value outside them. Reader
"auto" takes the small path only where `expected(n) >= ReaderPolicy.min_retention`.

Stored in `<cache folder>/retention/<hash of the key>.json` (key: both models' weights, the
forward translator's fingerprint, `large_reads_last` and `recompute_share`), written by the
evaluation; a demo pair's shipped translators carry theirs in `weights/manifest.json`.
A file that does not parse or whose points are malformed is ignored.
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

SCHEMA = "mlx-kvlingo/retention"
FOLDER = "retention"


@dataclass(frozen=True)
class Retention:
    """(read length, retention) points, lengths increasing; `source` says where they came from
    (a command, a commit)."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self):
        ns = [n for n, _ in self.points]
        ok = bool(ns) and ns == sorted(set(ns)) and all(n > 0 for n in ns)
        if not ok or not all(0.0 <= r <= 1.5 for _, r in self.points):
            raise ValueError(f"retention points must be increasing lengths > 0 with values in "
                             f"[0, 1.5] (got {self.points!r:.80})")  # fmt: skip

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

    def to_dict(self) -> dict:
        return {"points": [[n, r] for n, r in self.points], "source": self.source}

    @classmethod
    def from_dict(cls, d: object) -> Retention:
        """ValueError when `d` is not what `to_dict` writes."""
        try:
            pts = tuple((int(n), float(r)) for n, r in d["points"])  # type: ignore[index]
            if any(isinstance(n, bool) for n, _ in d["points"]):  # type: ignore[index]
                raise ValueError
            return cls(pts, str(d.get("source", "")))  # type: ignore[union-attr]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"not retention points: {d!r:.80}") from None


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


def load(k: dict, cache_dir: str | os.PathLike | None = None) -> Retention | None:
    """The retention stored for key `k`; None when there is none or it does not parse."""
    try:
        data = json.loads(path_for(k, cache_dir).read_text())
        if data.get("schema") != SCHEMA or data.get("key") != json.loads(json.dumps(k)):
            return None
        return Retention.from_dict(data["retention"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def save(k: dict, retention: Retention, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write it atomically (OSError when the cache folder cannot be written)."""
    path = path_for(k, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMA, "key": k, "retention": retention.to_dict()}
    return write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
