"""The public API under stress: threads x random operations over one loaded pair on the tiny
known-answer pair (send small/large, cancel from another thread, escalate, save, restore,
reset, trim), invariants checked after every operation.

    python tests/tools/stress_api.py                    # 8 threads x 50 operations
    python tests/tools/stress_api.py --threads 16 --ops 200 --seed 3

The harness is `tests/stress.py`; the test suite runs 4 x 20 (`tests/test_robustness.py`).
Exit status 1 on a failure (an unexpected error, a broken invariant, a deadlock).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import mlx_kvlingo  # noqa: E402, F401  (OpenBLAS before mlx)

import fuzzing  # noqa: E402
import stress  # noqa: E402


def main(work: Path, argv=None) -> int:
    from mlx_kvlingo import load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--ops", type=int, default=50, help="operations per thread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="deadline (s): later is a deadlock")
    ap.add_argument("--fixtures", type=Path, default=None, help="reuse a fixtures folder")
    args = ap.parse_args(argv)
    f = fuzzing.build_fixtures(args.fixtures or work / "fixtures")
    runtime = load(f / "qwen3", f / "known", f / "fwd.safetensors", f / "bwd.safetensors")
    r = stress.stress(runtime, work / "files", threads=args.threads, ops=args.ops,
                      seed=args.seed, timeout=args.timeout)  # fmt: skip
    ops = ", ".join(f"{k} {v}" for k, v in sorted(r.ops.items()))
    errors = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "none"
    print(f"| threads x ops | operations | ops/s | tokens generated | slowest op (s) | expected "
          f"errors | failures | deadlock |\n|---|---:|---:|---:|---:|---|---:|---|\n"
          f"| {args.threads} x {args.ops} | {r.total} | {r.ops_per_s:.1f} | {r.tokens} | "
          f"{r.slowest_op_s:.2f} | {errors} | {len(r.failures)} | {'yes' if r.deadlocked else 'no'} |")  # fmt: skip
    print(f"\noperations: {ops}")
    for f_ in r.failures[:10]:
        print(f"  failure: {f_}", file=sys.stderr)
    return 1 if r.failures or r.deadlocked else 0


if __name__ == "__main__":
    sys.exit(fuzzing.run_in_work_folder(main, "kvlingo-stress-"))
