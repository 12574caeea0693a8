"""This pair's rates on this machine: what reading costs, which reader "auto" weighs (reader.py),
kept in the cache folder between processes.

Time. A read of n tokens by a model holding `at` costs a + b n + c n (at + n / 2) seconds, a
translation a + b n. Each of the five costs (`NAMES`; target_read: the large model's read of
n >= 2 tokens up to its first token, target_step: of one) is a nonnegative least-squares fit to
its last `KEEP` measurements (the warm-up's and every turn's), each weighing `DECAY` of the
next. Per large turn auto predicts both ways its answer can start (`Paths`):

    large reads   target_read(lacked, at=held)
    small reads   catch-up (backward(k), or the small reads it too) + source_read(read)
                  + forward(lacked - tail) + target_read(recompute + 2 tail, at the turn's
                  end) + target_step (target_step alone for a one-token tail, no recompute)

Files: `<cache folder>/<folder>/<hash of the key>.json` (`read`, `write`; retention.py's too),
written atomically; the rates keyed by `rates_key` (machine, pair, versions, lengths). One that
does not parse, or whose schema or key differs, is ignored.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_kvlingo._platform import blas
from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo._platform.cachedir import cache_root
from mlx_kvlingo.kv.recompute import large_reads
from mlx_kvlingo.models.pair import model_fingerprint

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DECAY, KEEP = 0.7, 12
NAMES = ("source_read", "forward", "backward", "target_read", "target_step")
SCHEMA = "mlx-kvlingo/rates-3"  # 3: no load factor; probes replace their own sample
RATES = "rates"  # the cache folder's subfolder


@dataclass
class Cost:
    """seconds = a + b n + c n (at + n / 2) over recent (n, seconds, at); c = 0 without
    `attention`."""

    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    frozen: bool = False  # ignores measurements (exact costs a test injects)
    attention: bool = True

    def observe(self, n: int, seconds: float, at: int = 0, again: bool = False) -> None:
        """A read of n tokens over `at` took `seconds`; `again`: it replaces the samples of the
        same (n, at) (a probe repeated by a later start)."""
        if n > 0 and seconds > 0 and at >= 0 and not self.frozen:
            if again:
                self.samples = deque([x for x in self.samples if (x[0], x[2]) != (n, at)], KEEP)
            self.samples.append((int(n), float(seconds), int(at)))

    @property
    def ready(self) -> bool:
        """Measured at two lengths at least (an intercept and a slope)."""
        return len({n for n, _, _ in self.samples}) >= 2

    def features(self, n: int, at: int = 0) -> tuple[float, ...]:
        return (1.0, float(n), n * (at + n / 2))[: 3 if self.attention else 2]

    def fit(self) -> tuple[float, ...] | None:
        """(a, b, c) (without attention (a, b)), each >= 0, None before any measurement: of the
        subsets of terms whose weighted least squares are all >= 0, the smallest error (b is
        always fitted, alone through 0 at least)."""
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
        """Seconds to read `n` tokens over `at` held (None before any measurement)."""
        coef = self.fit() if n > 0 else ()
        return None if coef is None else float(np.dot(coef, self.features(n, at)[: len(coef)]))


@dataclass
class ReadCosts:
    """The five costs of one pair in this process (see the module docstring)."""

    source_read: Cost = field(default_factory=Cost)
    forward: Cost = field(default_factory=lambda: Cost(attention=False))
    backward: Cost = field(default_factory=lambda: Cost(attention=False))
    target_read: Cost = field(default_factory=Cost)
    target_step: Cost = field(default_factory=lambda: Cost(attention=False))
    warmup_s: float | None = None  # how long the last warm-up took (None: none ran)
    origin: str | None = None  # the rates "measured" by this process or "cached" (warmup.py)

    def to_dict(self) -> dict[str, list[list[float]]]:
        """{name: [[n, seconds, at], ...]} oldest first (what `from_dict` takes)."""
        return {name: [list(x) for x in getattr(self, name).samples] for name in NAMES}

    @classmethod
    def from_dict(cls, data: object) -> ReadCosts:
        """ValueError unless `data` is `to_dict`'s: each name, at most KEEP [n, seconds, at]."""
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
        """The large model read n tokens over the `at` it held up to its first token."""
        (self.target_step if n == 1 else self.target_read).observe(n, seconds, 0 if n == 1 else at)

    def large_reads(self, lacked: int, at: int = 0) -> float | None:
        """Predicted TTFT with the large model reading `lacked` tokens itself over `at`."""
        if lacked == 1:
            return self.target_step.predict(1) if self.target_step.samples else None
        return self.target_read.predict(lacked, at) if self.target_read.ready else None


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
        """The small path's TTFT (module docstring); None where a cost it needs is unmeasured."""
        c, back = costs, bool(self.catch_up and self.backward)
        if not (c.source_read.ready and c.forward.ready and (c.backward.ready or not back)):
            return None
        at = self.held + self.lacked - self.recompute - self.tail  # the large model's last read
        large = c.large_reads(large_reads(self.tail, self.recompute), at)
        step = c.large_reads(1) if self.recompute else 0.0
        if large is None or step is None:
            return None
        if back:  # the small model catches up by backward translation, then reads
            small = c.backward.predict(self.catch_up) + c.source_read.predict(
                self.read, self.small_held + self.catch_up
            )
        else:  # it reads what it lacks of the large model's answers with the turn
            small = c.source_read.predict(self.catch_up + self.read, self.small_held)
        return small + c.forward.predict(self.lacked - self.tail) + large + step


def costs_of(pair) -> ReadCosts:
    """The costs measured on `pair` in this process, shared by its conversations."""
    return pair.__dict__.setdefault("_kvlingo_read_costs", ReadCosts())


def fingerprints(pair, *translators) -> list[str | None]:
    """Both models (weights, dtype, type, quantization) and each translator (its class,
    settings and the first entries of each weight), as fingerprints."""

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
    """Machine (platform, device, BLAS, threads), pair files, library versions, lengths."""
    info = mx.device_info()  # its chip (on Linux the CPU's model name) and memory
    env = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "KVLINGO_CPU_MEMORY")
    machine = [platform.platform(), os.cpu_count(), str(mx.default_device()), blas.loaded_path,
               *(str(info.get(k)) for k in ("device_name", "memory_size")),
               *map(os.environ.get, env)]  # fmt: skip
    ours = getattr(sys.modules.get("mlx_kvlingo"), "__version__", None)  # a checkout's own
    versions = [importlib.metadata.version(d) for d in ("mlx", "mlx-lm")] + [ours]
    return {"machine": machine, "pair": fingerprints(pair, forward, backward), "versions": versions,
            "lengths": [int(n) for n in lengths]}  # fmt: skip


def path_for(folder: str | Path, k: dict) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / folder / f"{digest}.json"


def read(folder, k: dict) -> dict:
    """The file stored in `folder` for key `k`; {} where there is none to take (docstring)."""
    try:
        data = json.loads(path_for(folder, k).read_text())
        same = data.get("schema") == SCHEMA and data.get("key") == json.loads(json.dumps(k))
        return data if same else {}
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not a dict
        return {}


def write(folder, k: dict, **data) -> Path:
    """Store `data` for key `k` in `folder`, atomically; OSError where it cannot be written."""
    path = path_for(folder, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": SCHEMA, "key": k, **data}, indent=1, sort_keys=True)
    return write_text(path, text + "\n")
