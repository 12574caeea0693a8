"""Tables and the plot of `long_documents` runs: facts kept and read time, path by path.

    python -m weights.experiments.long_documents_report RUN.jsonl [RUN2.jsonl ...] [--plot OUT.png]

Per kind and read length: the items drawn, those the native read got right, and for each path
the ones it kept of those (kept / right, the share) and the median of its read time over the
native read's on the same item ("read"; everything before the first decode step, side by side
in one process). Questions about a passage (`qa`) have no right answer: each path's mean recall
of the native answer's content words over the items instead. The plot: read time against facts kept, one line per path across the lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.eval import report

MIN_RETENTION = ReaderPolicy().min_retention


def load(paths) -> dict:
    """{(kind, length, step, pair): {condition: record}} over every run file; each record keeps
    the read time of the native read in its own run (`native_s`), its ratio's reference."""
    items: dict = {}
    for p in paths:
        rows = [json.loads(line) for line in Path(p).read_text().splitlines()]
        key = lambda r: (r["kind"], r["length"], r["step"], r.get("pair"))  # noqa: E731
        native = {key(r): r["read_s"] for r in rows if r["condition"] == "native"}
        for r in rows:
            if key(r) in native:
                items.setdefault(key(r), {})[r["condition"]] = {**r, "native_s": native[key(r)]}
    return items


def summary(items: dict) -> dict:
    """{(kind, length): {"n", "right", "commits", "paths": {path: (kept, read ratio)}}}."""
    out: dict = {}
    for (kind, n, _, _), by in sorted(items.items()):
        nat = by.get("native")
        if nat is None:
            continue
        cell = out.setdefault((kind, n), {"n": 0, "right": 0, "commits": set(), "paths": {}})
        cell["n"] += 1
        cell["recall"] = "correct" not in nat  # qa: no right answer, the native's words recalled
        cell["right"] += bool(nat.get("correct", True))
        cell["commits"].add(nat.get("commit", "?"))
        for c, r in by.items():
            if c == "native":
                continue
            kept, ratios = cell["paths"].setdefault(c, ([], []))
            if cell["recall"]:
                kept.append(r["recall"])
            elif nat["correct"]:
                kept.append(bool(r["correct"]))
            ratios.append(r["read_s"] / r["native_s"])
    for cell in out.values():
        cell["paths"] = {
            c: (sum(k), len(k), statistics.median(v)) for c, (k, v) in cell["paths"].items()
        }
    return out


def markdown(s: dict) -> str:
    paths = sorted({c for cell in s.values() for c in cell["paths"]}, key=_order)
    head = (
        "| kind | read tok | native right | " + " | ".join(f"{c}: kept, read" for c in paths) + " |"
    )
    rows = [head, "| --- | ---: | ---: | " + " | ".join("---:" for _ in paths) + " |"]
    for (kind, n), cell in sorted(s.items()):
        cols = []
        for c in paths:
            if c not in cell["paths"]:
                cols.append("")
                continue
            k, r, ratio = cell["paths"][c]
            if cell["recall"]:
                cols.append(f"recall {k / r:.2f} of {r}, {ratio:.2f}")
                continue
            share = f" ({k / r:.2f})" if r else ""
            cols.append(f"{k}/{r}{share}, {ratio:.2f}")
        rows.append(f"| {kind} | {n} | {cell['right']}/{cell['n']} | " + " | ".join(cols) + " |")
    commits = sorted({c for cell in s.values() for c in cell["commits"]})
    return "\n".join(rows) + f"\n\ncommits: {', '.join(commits)}\n"


def _order(c: str) -> tuple:
    return (not c.startswith("chat"), c)


def plot(s: dict, path: Path, kind: str = "fact") -> Path:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    cells = {n: cell for (k, n), cell in sorted(s.items()) if k == kind}
    paths = sorted({c for cell in cells.values() for c in cell["paths"]}, key=_order)
    ax.plot([1.0], [1.0], marker="*", markersize=12, color="black", linestyle="",
            label="large model reads itself")  # fmt: skip
    for c in paths:
        pts = [
            (n, cell["paths"][c])
            for n, cell in cells.items()
            if c in cell["paths"] and cell["paths"][c][1]
        ]
        xs, ys = [p[2] for _, p in pts], [p[0] / p[1] for _, p in pts]
        ax.plot(xs, ys, marker="o", label=c)
        for (n, _), x, y in zip(pts, xs, ys):
            ax.annotate(f"{round(n / 1000)}k", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)  # fmt: skip
    ax.axhline(MIN_RETENTION, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("time to read the prompt / the large model's own read (median)")
    ax.set_ylabel("facts kept / native right")
    ax.set_ylim(-0.03, 1.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"{kind}: one point per read length (counts: eval/RESULTS.md)", fontsize=9)
    return report.save_figure(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    s = summary(load(args.runs))
    print(markdown(s))
    if args.plot:
        print(plot(s, args.plot))


if __name__ == "__main__":
    main()
