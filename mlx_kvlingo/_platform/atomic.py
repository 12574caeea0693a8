"""Crash-safe file writes: a temporary file (unique per call) in the target's directory,
fsynced, then `os.replace`d over the target (atomic within one directory). A writer killed at
any point leaves the previous file or the new one, at most with a `.NAME.*.tmp*` file beside it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path: str | Path, suffix: str = ".safetensors") -> Iterator[Path]:
    """Yield a temporary path to write (mlx's savers need the `.safetensors` suffix); on success
    it replaces `path`, on error it is removed (an mlx saver that cannot write its file raises
    OSError, as `open` would).

    with atomic_write(out) as tmp:
        mx.save_safetensors(str(tmp), tensors)
    """
    path = Path(path)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}"
    name = f".{path.name}.{tag}"
    tmp = path.with_name(name if len(name.encode()) <= 200 else f".kvlingo-{tag}")  # name limits
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, RuntimeError) and str(e).startswith("[save"):  # "[save_safetensors] ..."
            raise OSError(f"cannot write {path}: {e}") from None
        raise
    with contextlib.suppress(OSError):  # not possible everywhere (Windows): the rename is atomic
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(path: str | Path, text: str) -> Path:
    """`Path.write_text`, crash-safe."""
    path = Path(path)
    with atomic_write(path, ".tmp") as tmp:
        tmp.write_text(text)
    return path


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """Atomically make `dst` a hard link to `src` (a copy where links are not possible)."""
    with atomic_write(dst, Path(dst).suffix or ".tmp") as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
