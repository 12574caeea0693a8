"""CPU memory reuse (`mlx_kvlingo/_cpu_memory.py`) on and off: one translation into a fresh
cache right after `mx.clear_cache()` (as a turn meets it after mlx-lm's prefill), the first
at each length and the repeats, in fresh processes that alternate between the two settings.

    python -m mlx_kvlingo.measure.memory_reuse --pair dense --processes 3

The setting is process-wide (glibc's thresholds cannot be put back), so each measurement is
its own process; alternating them spreads a loaded machine's noise over both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LENGTHS = (64, 256, 1024)


def measure(pair_name: str, lengths, rounds: int) -> dict:
    """This process's times (s): {length: {"first": t, "repeats": [t, ...]}}."""
    import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
    from mlx_kvlingo.capture import SpanKV
    from mlx_kvlingo.demo.pair import load_demo
    from mlx_kvlingo.kvcache import append_kv, new_cache

    import mlx.core as mx

    pair, tr = load_demo(pair=pair_name)
    s = pair.source.geometry
    out = {}
    for n in lengths:
        shape = (s.layers, 1, s.kv_heads, n, s.head_dim)
        span = SpanKV(mx.random.normal(shape), mx.random.normal(shape), start=0)
        mx.eval(span.keys, span.values)
        times = []
        for _ in range(rounds):
            mx.clear_cache()
            t0 = time.perf_counter()
            append_kv(new_cache(pair.target), *tr.translate(span, pair.target))
            times.append(time.perf_counter() - t0)
        out[n] = {"first": times[0], "repeats": times[1:]}
    return out


def run(pair_name: str, processes: int, rounds: int, lengths=LENGTHS) -> dict:
    results = {"tuned": [], "default": []}
    for _ in range(processes):
        for setting in ("tuned", "default"):
            env = dict(os.environ)
            env.pop("KVLINGO_CPU_MEMORY", None)
            if setting == "default":
                env["KVLINGO_CPU_MEMORY"] = "default"
            cmd = [sys.executable, "-m", "mlx_kvlingo.measure.memory_reuse", "--child", "--pair", pair_name,
                   "--rounds", str(rounds), "--lengths", ",".join(map(str, lengths))]  # fmt: skip
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[setting].append(json.loads(got.stdout.strip().splitlines()[-1]))
    return results


def markdown(results: dict, lengths=LENGTHS) -> str:
    import numpy as np

    lines = [
        "| setting | " + " | ".join(f"{n}: first / repeat ms" for n in lengths) + " |",
        "| --- |" + " ---: |" * len(lengths),
    ]
    for setting, runs in results.items():
        cells = []
        for n in lengths:
            first = [1e3 * r[str(n)]["first"] for r in runs]
            rep = [1e3 * t for r in runs for t in r[str(n)]["repeats"]]
            cells.append(f"{np.median(first):.1f} / {np.median(rep):.1f}")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="dense", choices=("dense", "moe"))
    ap.add_argument("--processes", type=int, default=3, help="processes per setting")
    ap.add_argument("--rounds", type=int, default=8, help="translations per length and process")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    lengths = tuple(int(x) for x in a.lengths.split(","))
    if a.child:
        print(json.dumps(measure(a.pair, lengths, a.rounds)))
        return
    print(markdown(run(a.pair, a.processes, a.rounds, lengths), lengths))


if __name__ == "__main__":
    main()
