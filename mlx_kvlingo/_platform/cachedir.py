"""The user cache folder, and folders built once into it: stamped, written to a temp dir,
renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $KVLINGO_CACHE, else ~/.cache/mlx-kvlingo."""
    if cache_dir is None:
        cache_dir = os.environ.get("KVLINGO_CACHE") or Path.home() / ".cache" / "mlx-kvlingo"
    return Path(cache_dir).expanduser()


def stamp_ok(folder: Path, stamp: dict, stamp_name: str) -> bool:
    """Whether `folder` was built (completely) for exactly this `stamp`."""
    try:
        return json.loads((folder / stamp_name).read_text()) == stamp
    except (OSError, ValueError):
        return False


def build_atomically(
    final: Path, stamp: dict, build: Callable[[Path], None], stamp_name: str
) -> Path:
    """Reuse `final` if its stamp matches, else `build(tmp)` and rename into place.

    A concurrent builder that wins the rename is fine: we keep its folder if it matches.
    """
    if stamp_ok(final, stamp, stamp_name):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        (tmp / stamp_name).write_text(json.dumps(stamp, indent=1))
        if final.exists():  # stale: move it aside, then swap in the new one
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
            os.replace(final, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    except OSError:
        if not stamp_ok(final, stamp, stamp_name):  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
