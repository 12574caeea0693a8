"""This pair's read rates on this machine, kept in the cache folder between processes.

What the warm-up measures (`warmup.py`: the read costs of `timing.py` that reader "auto" decides
by, and the way each translator's maps read the source fastest, `kv.translator.measure`) depends
on the machine, the pair's files and the libraries that run them, not on the process. It is
written to `<cache folder>/rates/<hash of the key>.json` (the cache folder: `KVLINGO_CACHE`,
default `~/.cache/mlx-kvlingo`) and reused by a later start whose key is the same:

    machine    platform, processor, CPU count, MLX's default device and its name, the BLAS
               MLX's CPU backend was given and the thread counts set for it
    pair       per model: a fingerprint of its weights (`persistence.model_fingerprint`), its
               dtype and quantization; per translator: its geometry, layer maps, dtype and a
               fingerprint of its weights
    versions   mlx, mlx-lm, mlx-kvlingo, and the warm-up's lengths

A file whose key differs (another machine's, an older version's), that does not parse, or whose
rates are not well formed is ignored: the warm-up measures again and writes it anew. Writes are
atomic (`_platform.atomic`); a cache folder that cannot be written only means measuring again
next time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo._platform.cachedir import cache_root
from mlx_kvlingo.conversation.timing import ReadCosts
from mlx_kvlingo.kv.translator import MapReading

SCHEMA = "mlx-kvlingo/rates"
SCHEMA_VERSION = 2  # 2: samples hold where each read began (the attention term)
FOLDER = "rates"
DIRECTIONS = ("forward", "backward")


@dataclass
class Stored:
    """What a file holds: the costs, and the map reading per translator direction."""

    costs: ReadCosts
    readings: dict[str, MapReading]
    measured_s: float | None = None  # how long the measuring warm-up took


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _chip() -> str:
    """The processor's model name (platform.processor() is empty on most Linux systems)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict:
    """What the rates depend on in the machine (see the module docstring)."""
    from mlx_kvlingo._platform import blas

    import mlx.core as mx

    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):  # an MLX without it
        info = {}
    keep = ("architecture", "device_name", "memory_size")
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "chip": _chip(),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "device_info": {k: str(info[k]) for k in keep if k in info},
        "blas": blas.loaded_path,
        "threads": {
            k: os.environ.get(k)
            for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "KVLINGO_CPU_MEMORY")
        },
    }


def versions() -> dict:
    # the package's own version as it runs (a checkout's may differ from an installed one's);
    # the package is imported whenever this module is
    ours = getattr(sys.modules.get("mlx_kvlingo"), "__version__", None)
    return {
        "mlx": _version("mlx"),
        "mlx-lm": _version("mlx-lm"),
        "mlx-kvlingo": ours or _version("mlx-kvlingo"),
    }


def _model(loaded) -> dict:
    from mlx_kvlingo.conversation.persistence import model_fingerprint

    return {
        "fingerprint": model_fingerprint(loaded),
        "dtype": str(loaded.dtype),
        "model_type": loaded.config.get("model_type"),
        "quantization": loaded.config.get("quantization"),
    }


def translator_fingerprint(translator) -> dict | None:
    """A translator's geometry, layer maps, dtype and the first entries of each weight."""
    if translator is None:
        return None
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    c = translator.config
    h = hashlib.sha256()
    leaves: list = tree_flatten(translator.parameters())
    for name, w in sorted(leaves, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(w.shape)}:{w.dtype}".encode())
        if mx.issubdtype(w.dtype, mx.floating):
            h.update(np.array(w.reshape(-1)[:256].astype(mx.float32)).tobytes())
    return {
        "class": type(translator).__name__,
        "variant": c.variant,
        "source": c.source.as_dict(),
        "target": c.target.as_dict(),
        "key_layers": [list(r) for r in c.key_layers],
        "value_layers": [list(r) for r in c.value_layers],
        "key_cut": c.key_cut,
        "bias": c.bias,
        "native_first": c.native_first,
        "rank": c.rank,
        "weights": h.hexdigest()[:16],
    }


def key(pair, forward, backward, lengths) -> dict:
    """The key a stored file must match exactly (see the module docstring)."""
    return {
        "machine": machine(),
        "pair": {
            "source": _model(pair.source),
            "target": _model(pair.target),
            "forward": translator_fingerprint(forward),
            "backward": translator_fingerprint(backward),
        },
        "versions": versions(),
        "lengths": [int(n) for n in lengths],
    }


def path_for(k: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root(cache_dir) / FOLDER / f"{digest}.json"


def load(k: dict, cache_dir: str | os.PathLike | None = None) -> Stored | None:
    """The rates stored for key `k`, or None: no file, or one to ignore (unreadable, not JSON,
    another schema or key, malformed rates)."""
    try:
        data = json.loads(path_for(k, cache_dir).read_text())
    except (OSError, ValueError):  # missing, unreadable, not JSON (UnicodeDecodeError too)
        return None
    try:
        if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
            return None
        if data.get("key") != json.loads(json.dumps(k)):  # as it reads back (tuples: lists)
            return None
        readings = data["map_reading"]
        if not isinstance(readings, dict) or not set(readings) <= set(DIRECTIONS):
            return None
        measured = data.get("measured_s")
        return Stored(
            ReadCosts.from_dict(data["costs"]),
            {d: MapReading.from_dict(r) for d, r in readings.items()},
            float(measured) if isinstance(measured, (int, float)) else None,
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def save(
    k: dict, costs: ReadCosts, readings: dict[str, MapReading],
    cache_dir: str | os.PathLike | None = None,
) -> Path | None:  # fmt: skip
    """Write the rates for key `k` atomically; None when the cache folder cannot be written."""
    path = path_for(k, cache_dir)
    data = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "key": k,
        "costs": costs.to_dict(),
        "map_reading": {d: r.to_dict() for d, r in readings.items()},
        "measured_s": costs.warmup_s,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError:
        return None
