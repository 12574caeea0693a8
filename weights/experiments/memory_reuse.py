"""CPU memory reuse (`mlx_kvlingo/_platform/cpu_memory.py`) on and off: one translation into a fresh
cache right after `mx.clear_cache()` (as a turn meets it after mlx-lm's prefill), the first
at each length and the repeats, in fresh processes that alternate between the two settings.

    python -m weights.experiments.memory_reuse --pair dense --processes 3

With `--new-lengths`, translations at lengths in the order a conversation meets them (each
three times, no `mx.clear_cache()` between): the first at each new length against its repeats,
and the first one's minor page faults, with the shipped setting (malloc tuned, MLX's cache at
its default, 1024 tokens reserved as the warm-up does) against each part taken away:

    python -m weights.experiments.memory_reuse --pair dense --processes 2 --new-lengths

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
    from mlx_kvlingo.kv.cache import append_kv, new_cache
    from mlx_kvlingo.kv.capture import SpanKV
    from mlx_kvlingo.models.demo.pair import load_demo

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


#: --new-lengths: the order of lengths, and the settings (KVLINGO_CPU_MEMORY, MLX cache limit
#: or None for MLX's default, tokens reserved)
SEQUENCE = (256, 1024, 512, 64, 768)
NEW_LENGTH_SETTINGS = {
    "shipped": ("", None, 1024),
    "no reserve": ("", None, 0),
    "MLX cache 4 GB": ("", 4 << 30, 1024),
    "malloc as glibc sets it": ("default", None, 1024),
}


def measure_new_lengths(pair_name: str, sequence, repeats: int, reserve: int, cache_limit) -> list:
    """[(length, [ms, ...], minor faults of the first)] for one process."""
    import resource

    import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
    from mlx_kvlingo.kv.cache import append_kv, new_cache
    from mlx_kvlingo.kv.capture import SpanKV
    from mlx_kvlingo.kv.translator import reserve_translation_memory
    from mlx_kvlingo.models.demo.pair import load_demo

    import mlx.core as mx

    pair, tr = load_demo(pair=pair_name)
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)
    s = pair.source.geometry
    spans = {}
    for n in sorted({64, *sequence}):
        shape = (s.layers, 1, s.kv_heads, n, s.head_dim)
        spans[n] = SpanKV(mx.random.normal(shape), mx.random.normal(shape), start=0)
        mx.eval(spans[n].keys, spans[n].values)

    def translate(n):
        cache = new_cache(pair.target)
        append_kv(cache, *tr.translate(spans[n], pair.target))
        mx.eval([c.state for c in cache])

    translate(64)  # compiles
    if reserve:
        reserve_translation_memory(pair.target, tr, reserve)
    rows = []
    for n in sequence:
        times, faults = [], 0
        for i in range(repeats):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            translate(n)
            times.append(1e3 * (time.perf_counter() - t0))
            if i == 0:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        rows.append((n, times, faults))
    return rows


def _in_child(args: list[str], memory_setting: str):
    """This module's child measurement in a fresh process (the setting is process-wide), with
    KVLINGO_CPU_MEMORY=`memory_setting` ("" for the shipped tuning); its JSON result."""
    env = dict(os.environ)
    env.pop("KVLINGO_CPU_MEMORY", None)
    if memory_setting:
        env["KVLINGO_CPU_MEMORY"] = memory_setting
    cmd = [sys.executable, "-m", "weights.experiments.memory_reuse", *args]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def run_new_lengths(pair_name: str, processes: int, sequence=SEQUENCE, repeats: int = 3) -> dict:
    results = {k: [] for k in NEW_LENGTH_SETTINGS}
    for _ in range(processes):
        for name, (opt, limit, reserve) in NEW_LENGTH_SETTINGS.items():
            args = ["--child-new", "--pair", pair_name, "--reserve", str(reserve),
                    "--cache-limit", str(limit or 0), "--lengths", ",".join(map(str, sequence)),
                    "--rounds", str(repeats)]  # fmt: skip
            results[name].append(_in_child(args, opt))
    return results


def markdown_new_lengths(results: dict, sequence=SEQUENCE) -> str:
    import numpy as np

    lines = [
        "| setting | " + " | ".join(f"{n}: first / repeat ms (faults)" for n in sequence) + " |",
        "| --- |" + " ---: |" * len(sequence),
    ]
    for setting, runs in results.items():
        cells = []
        for i in range(len(sequence)):
            first = np.median([r[i][1][0] for r in runs])
            rep = np.median([t for r in runs for t in r[i][1][1:]])
            faults = np.median([r[i][2] for r in runs])
            cells.append(f"{first:.0f} / {rep:.0f} ({faults:.0f})")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(pair_name: str, processes: int, rounds: int, lengths=LENGTHS) -> dict:
    results = {"tuned": [], "default": []}
    for _ in range(processes):
        for setting in ("tuned", "default"):
            args = ["--child", "--pair", pair_name, "--rounds", str(rounds),
                    "--lengths", ",".join(map(str, lengths))]  # fmt: skip
            results[setting].append(_in_child(args, "default" if setting == "default" else ""))
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
    ap.add_argument("--new-lengths", action="store_true",
                    help="the first translation at each new length, by setting (see above)")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-new", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reserve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cache-limit", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_new:
        rows = measure_new_lengths(a.pair, [int(x) for x in a.lengths.split(",")], a.rounds,
                                   a.reserve, a.cache_limit or None)  # fmt: skip
        print(json.dumps(rows))
        return
    if a.new_lengths:
        print(markdown_new_lengths(run_new_lengths(a.pair, a.processes)))
        return
    lengths = tuple(int(x) for x in a.lengths.split(","))
    if a.child:
        print(json.dumps(measure(a.pair, lengths, a.rounds)))
        return
    print(markdown(run(a.pair, a.processes, a.rounds, lengths), lengths))


if __name__ == "__main__":
    main()
