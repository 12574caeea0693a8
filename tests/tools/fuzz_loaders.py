"""Fuzz every loader with seeded mutations and print what happened to each input, per loader.

    python tests/tools/fuzz_loaders.py                       # 10,000 inputs per loader (about an hour)
    python tests/tools/fuzz_loaders.py --count 300           # the test suite's size
    python tests/tools/fuzz_loaders.py --loaders session --start 4711 --count 1   # one input again

The harness is `tests/fuzzing.py` (its docstring says what counts as a failure); the test
suite runs a few hundred of the same inputs (`tests/test_robustness.py`). Exit status 1 when
any input ended as bug, hang, crash or wrote; `--keep DIR` saves those inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import mlx_kvlingo  # noqa: E402, F401  (OpenBLAS before mlx)

import fuzzing  # noqa: E402


def table(reports: list[fuzzing.Report], seed: int, start: int) -> str:
    rows = ["| loader | inputs | ok | refused | bug | hang | crash | wrote | s/1000 inputs | refused as |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in reports:
        c = r.counts
        top = ", ".join(f"{k} {v}" for k, v in r.refused_by.most_common(3))
        rows.append(
            f"| {r.loader} | {r.total:,} | {c['ok']:,} | {c['refused']:,} | {c['bug']} | "
            f"{c['hang']} | {c['crash']} | {c['wrote']} | {1000 * r.seconds / max(r.total, 1):.1f} "
            f"| {top} |"
        )
    return "\n".join(rows)


def main(work: Path, argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loaders", default=",".join(fuzzing.LOADERS),
                    help=f"comma-separated, of: {', '.join(fuzzing.LOADERS)}")  # fmt: skip
    ap.add_argument("--count", type=int, default=10_000, help="inputs per loader")
    ap.add_argument("--start", type=int, default=0, help="first input index")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=10.0, help="seconds allowed per input")
    ap.add_argument("--fixtures", type=Path, default=None, help="reuse a fixtures folder")
    ap.add_argument("--keep", type=Path, default=None, help="save failing inputs here")
    ap.add_argument("--json", type=Path, default=None, help="write the reports as JSON")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    loaders = [x for x in args.loaders.split(",") if x]
    unknown = set(loaders) - set(fuzzing.LOADERS)
    if unknown:
        ap.error(f"unknown loaders {sorted(unknown)}")
    fixtures = fuzzing.build_fixtures(args.fixtures or work / "fixtures")
    worker = fuzzing.Worker(fixtures, work / "box")
    reports = []
    t0 = time.perf_counter()
    try:
        for loader in loaders:

            def progress(r, i, loader=loader):
                if not args.quiet and (r.total % 500 == 0 or r.failures and r.findings[-1][0] == i):
                    c = r.counts
                    print(f"  {loader}: {r.total}/{args.count} ok {c['ok']} refused "
                          f"{c['refused']} failures {r.failures}", file=sys.stderr, flush=True)  # fmt: skip

            r = fuzzing.fuzz(loader, worker, fixtures, seed=args.seed, start=args.start,
                             count=args.count, limit=args.limit, keep=args.keep,
                             progress=progress)  # fmt: skip
            reports.append(r)
            if args.json:  # after every loader, so a long run that is stopped keeps its figures
                args.json.write_text(
                    json.dumps([x.as_dict() for x in reports], indent=1, default=str)
                )
            for i, outcome, how, detail in r.findings[:5]:
                print(f"{loader} #{i} {outcome} ({how}):\n  {detail[:800]}", file=sys.stderr)
    finally:
        worker.stop()
    print(f"seed {args.seed}, inputs {args.start}..{args.start + args.count - 1} per loader, "
          f"limit {args.limit:g} s per input, {time.perf_counter() - t0:.0f} s in all, "
          f"{worker.starts} worker start(s)\n")  # fmt: skip
    print(table(reports, args.seed, args.start))
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=1, default=str))
    return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
    sys.exit(fuzzing.run_in_work_folder(main, "kvlingo-fuzz-"))
