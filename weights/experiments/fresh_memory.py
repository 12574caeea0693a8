"""What first touching memory costs on this machine: pages the process has never held, pages
it just gave back, pages it gave back a while ago, against pages it holds.

    python -m weights.experiments.fresh_memory --mb 512 --idle 0,1,3,6

Each row allocates and fills `--mb` MB (numpy; a fresh mapping, as glibc serves a request
above its mmap threshold), frees it, and waits `--idle` seconds before the next. The last
column rewrites an array the process holds throughout. On a virtual machine whose guest
reports free pages to its host (Linux `page_reporting`, Firecracker's balloon), pages freed
for more than about a second are taken back by the host, and touching them again costs a
host-side fault per page: that is what a translation pays when its arrays grow the heap into
memory the process did not hold (`eval/RESULTS.md`, "Fresh memory on this machine").
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(mb: int, idles: list[float]) -> list[dict]:
    """One row per idle time: ms to allocate and fill `mb` MB, its minor faults, and ms to
    rewrite as much memory the process holds."""
    held = np.ones(mb * 2**20 // 8)
    rows = []
    for idle in idles:
        time.sleep(idle)
        f0, t0 = _minor_faults(), time.perf_counter()
        fresh = np.ones(mb * 2**20 // 8)
        fill_ms = 1e3 * (time.perf_counter() - t0)
        faults = _minor_faults() - f0
        t0 = time.perf_counter()
        held[:] = idle
        rows.append({"idle_s": idle, "fill_ms": fill_ms, "faults": faults,
                     "held_rewrite_ms": 1e3 * (time.perf_counter() - t0)})  # fmt: skip
        del fresh
    return rows


def markdown(mb: int, rows: list[dict]) -> str:
    out = [
        f"| idle before, s | allocate + fill {mb} MB, ms | minor faults | "
        f"rewrite {mb} MB held, ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(f"| {r['idle_s']:g} | {r['fill_ms']:.0f} | {r['faults']} | "
                   f"{r['held_rewrite_ms']:.0f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--idle", default="0,0,1,3,6", help="seconds idle before each row")
    args = ap.parse_args(argv)
    idles = [float(v) for v in args.idle.split(",")]
    print(markdown(args.mb, measure(args.mb, idles)))


if __name__ == "__main__":
    main()
