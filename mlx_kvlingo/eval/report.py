"""What the measuring commands write: the machine and software, strict JSON (NaN as null),
markdown tables and headless figures."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from mlx_kvlingo._platform import blas as _blas
from mlx_kvlingo.models.pair import physical_memory

import mlx.core as mx
import numpy as np


def run_info() -> dict:
    """created, command, machine (load average now) and software of a result measured now."""
    from mlx_kvlingo import __version__

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    gpu = mx.default_device().type == mx.gpu
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {
            "os": platform.platform(),
            "arch": platform.machine(),
            "cpu": cpu[1].strip() if cpu else platform.processor(),
            "cpu_count": os.cpu_count(),
            "memory_GB": round(physical_memory() / 1e9, 1),
            "backend": ("metal" if mx.metal.is_available() else "cuda") if gpu else "cpu",
            "device": mx.device_info() if hasattr(mx, "device_info") else {},
            "blas": _blas.loaded_path or f"none preloaded ({_blas.reason})",
            "load_average": load_average(),
        },
        "software": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx-lm": importlib.metadata.version("mlx-lm"),
            "mlx-kvlingo": __version__,
            "numpy": np.__version__,
            "commit": git_commit(),
        },
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def git_commit() -> str | None:
    """The checkout's short commit ("+dirty" with changes; None outside one)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    describe = ["git", "-C", str(root), "describe", "--always", "--dirty=+dirty", "--exclude=*"]
    try:
        run = subprocess.run(describe, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def stats(values: Iterable) -> dict | None:
    """n, median, mean, std (ddof 1), min and max of the values but None (None: no values)."""
    v = np.asarray([x for x in values if x is not None], float)
    if not v.size:
        return None
    return {"n": int(v.size), "median": float(np.median(v)), "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if v.size > 1 else 0.0, "min": float(v.min()),
            "max": float(v.max())}  # fmt: skip


def machine_line(m: dict, sw: dict) -> str:
    """One line naming the machine and software of `machine_info()` and `software_info()`."""
    return (f"{m['backend']} · {m['cpu']} ({m['cpu_count']} cores, {m['memory_GB']} GB) · "
            f"BLAS {m['blas']} · mlx {sw['mlx']} · mlx-lm {sw['mlx-lm']} · {m['os']}"
            + (f" · commit {sw['commit']}" if sw.get("commit") else ""))  # fmt: skip


def load_span(m: dict) -> str:
    """The load averages at start and end, as "load average a/b/c at start, d/e/f at end"."""
    start, end = (m.get(k) for k in ("load_average", "load_average_end"))
    text = [("n/a" if not a else "/".join(f"{x:.1f}" for x in a)) for a in (start, end)]
    return f"load average {text[0]} at start, {text[1]} at end"


def number(x: float | None, fmt: str = ".2f", none: str = "") -> str:
    """`x` formatted by `fmt`; `none` for None, "n/a" for NaN."""
    if x is None:
        return none
    return "n/a" if x != x else format(x, fmt)


def write(out_dir: str | Path, name: str, result, markdown: str, plot=None,
          figure: str | None = None) -> dict[str, Path]:  # fmt: skip
    """`out_dir`/NAME.json, NAME.md and with `plot(result, path)` its figure (default NAME.png);
    the paths by role ("json", "markdown", "plot")."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(result, out / f"{name}.json"), "markdown": out / f"{name}.md"}
    paths["markdown"].write_text(markdown)
    if plot is not None:
        paths["plot"] = plot(result, out / (figure or f"{name}.png"))
    return paths


def jsonable(x):
    """`x` as strict JSON holds it (NaN and infinities as null, NumPy scalars as numbers, the
    unknown as its `str`)."""
    text = json.dumps(x, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    return json.loads(text, parse_constant=lambda _: None)


def write_json(result, path: str | Path) -> Path:
    """Write `jsonable(result)` to `path`, indented, with a final newline."""
    path = Path(path)
    path.write_text(json.dumps(jsonable(result), indent=1) + "\n")
    return path


def md_row(cells: Iterable) -> str:
    """One markdown table row: `| a | b |`."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(columns: Sequence[str], align: str, rows: Iterable[Iterable] = ()) -> list[str]:
    """Header, rule and rows of a markdown table; `align`: "l" or "r" per column."""
    rule = md_row("---:" if a == "r" else "---" for a in align)
    return [md_row(columns), rule, *(md_row(r) for r in rows)]


def pyplot():
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Lay `fig` out, write it to `path` and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
