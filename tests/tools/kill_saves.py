"""Kill savers with SIGKILL in the middle of a save, many times; the file must always load.

    python tests/tools/kill_saves.py                    # 50 kills per kind, 4 MB files
    python tests/tools/kill_saves.py --kinds session --kills 200

The harness is `tests/crashsafe.py` (its docstring says how); the test suite runs 50 kills in
all (`tests/test_robustness.py`). Exit status 1 when any file did not load. POSIX only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import mlx_kvlingo  # noqa: E402, F401  (OpenBLAS before mlx)

import crashsafe  # noqa: E402
import fuzzing  # noqa: E402


def main(work: Path, argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kinds", default=",".join(crashsafe.KINDS))
    ap.add_argument("--kills", type=int, default=50, help="kills per kind")
    ap.add_argument("--size-mb", type=float, default=4.0, help="translator file size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixtures", type=Path, default=None, help="reuse a fixtures folder")
    args = ap.parse_args(argv)
    fixtures = fuzzing.build_fixtures(args.fixtures or work / "fixtures")
    zygote = crashsafe.Zygote(fixtures)
    verifier = crashsafe.Verifier(fixtures)
    reports = []
    try:
        for kind in args.kinds.split(","):
            reports.append(crashsafe.kill_campaign(
                kind, args.kills, work / "runs", fixtures, seed=args.seed, size_mb=args.size_mb,
                zygote=zygote, verifier=verifier))  # fmt: skip
    finally:
        zygote.close()
    print(
        "| file | kills | loaded whole | the previous version | the new one | failures "
        "| mean save (ms) | temp files left |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in reports:
        print(
            f"| {r.kind} | {r.kills} | {r.intact} | {r.previous} | {r.newer} | "
            f"{len(r.failures)} | {r.save_ms:.1f} | {r.leftover_temp_files} |"
        )
        for k, why in r.failures[:5]:
            print(f"  {r.kind} kill {k}: {why}", file=sys.stderr)
    return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
    sys.exit(fuzzing.run_in_work_folder(main, "kvlingo-kill-"))
