"""Load OpenBLAS with global symbols before MLX, so the CPU backend's GEMMs use it.

The `mlx[cpu]` wheel links a reference BLAS; preloading Debian's `libopenblas0-pthread`
globally makes its sgemm resolve to OpenBLAS. On macOS (Accelerate/Metal) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = tuple(
    f"/usr/lib/{arch}-linux-gnu/openblas-pthread/{lib}"
    for lib in ("libblas.so.3", "libopenblas.so.0")
    for arch in ("x86_64", "aarch64")
)

#: Path of the BLAS library that was preloaded, or None.
loaded_path: str | None = None
#: Why nothing was preloaded (for `kvlingo info`).
reason: str = ""


def preload() -> str | None:
    """Preload OpenBLAS once; a no-op off Linux, when disabled or when absent."""
    global loaded_path, reason
    if loaded_path is not None:
        return loaded_path
    refusals = {
        "not Linux (MLX uses Accelerate / Metal)": not sys.platform.startswith("linux"),
        "disabled by KVLINGO_NO_OPENBLAS": bool(os.environ.get("KVLINGO_NO_OPENBLAS")),
        "mlx was imported before mlx_kvlingo; import mlx_kvlingo first": "mlx.core" in sys.modules,
    }
    reason = next((why for why, refused in refusals.items() if refused), "")
    if reason:
        return None
    for path in filter(os.path.exists, CANDIDATES):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:  # pragma: no cover - broken install
            reason = f"failed to load {path}: {e}"
            continue
        loaded_path = path
        return path
    reason = "OpenBLAS not found (apt-get install libopenblas0-pthread)"
    return None
