"""Several pairs benchmarked in one process, one after another, summarized side by side.

Each pair gets the full `bench.run_bench` sweep (its translation timed against a plain GEMM
of its own shapes in the same rounds, so its efficiency is a ratio within one run), is freed,
and the next is loaded. The summary puts, per pair and length, what the performance goals
judge next to each other: translation efficiency against the same-run GEMM (the maps alone
and the whole translation), translation against one target decode step, and the switch
speed-ups with and without the small model's prefill.

    kvlingo bench --side-by-side dense,moe,"qwen3-0.6b>qwen3-30b-a3b-scaled" --lengths 64,256,1024
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mlx_kvlingo.eval import bench, report

import mlx.core as mx

SCHEMA = "mlx-kvlingo/bench-side-by-side"
SCHEMA_VERSION = 1
#: the goals the summary checks (issue 28): efficiency at these lengths, translation/step at 64
EFFICIENCY_GOAL, EFFICIENCY_AT = 0.70, (256, 1024)
STEP_SHARE_GOAL = 0.10

Loader = Callable[[], tuple]  # () -> (pair, translator, info dict)


def run_side_by_side(
    loaders: Sequence[tuple[str, Loader]],
    lengths: Sequence[int],
    *,
    log: Callable[[str], None] = print,
    **bench_kwargs,
) -> dict:
    """`bench.run_bench` on each pair in turn (loaded by its loader, freed after); the results
    of every pair and the side-by-side summary."""
    started = time.perf_counter()
    out = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine_info(),
        "software": report.software_info(),
        "lengths": sorted(set(lengths)),
        "order": "one pair after another in this process; within a pair, bench's rounds",
        "pairs": {},
    }
    for name, load in loaders:
        log(f"== {name}")
        pair, translator, info = load()
        out["pairs"][name] = bench.run_bench(
            pair, translator, lengths, log=log, info=info, **bench_kwargs
        )
        del pair, translator
        gc.collect()
        mx.clear_cache()
    out["summary"] = summary(out)
    out["elapsed_s"] = time.perf_counter() - started
    return out


def summary(results: dict) -> list[dict]:
    """One row per pair and length: the figures the goals judge."""
    rows = []
    for name, r in results["pairs"].items():
        for key, v in r["lengths"].items():
            d, med = v["derived"], {p: s["median"] for p, s in v["stats"].items()}
            n = int(key)
            rows.append({
                "pair": name,
                "tokens": n,
                "translation_ms": 1e3 * med["translate"],
                "gemm_ms": 1e3 * med["gemm"],
                "efficiency": d["gemm_efficiency"],
                "map_efficiency": d["map_efficiency"],
                "translation_vs_target_step": d["translation_vs_target_step"],
                "gemm_vs_target_step": d["gemm_vs_target_step"],
                "switch_speedup": d["switch_speedup"],
                "end_to_end_speedup": d["end_to_end_speedup"],
                "source_vs_target_prefill": med["source_prefill"] / med["target_prefill"],
                "efficiency_goal_met": (d["gemm_efficiency"] >= EFFICIENCY_GOAL)
                if n in EFFICIENCY_AT else None,
            })  # fmt: skip
    return rows


def markdown(results: dict) -> str:
    m, sw = results["machine"], results["software"]
    lines = [
        "# Translation on several pairs, side by side",
        "",
        f"{m['backend']} · {m['cpu']} ({m['cpu_count']} cores, {m['memory_GB']} GB) · "
        f"BLAS {m['blas']} · mlx {sw['mlx']} · mlx-lm {sw['mlx-lm']} · {m['os']}"
        + (f" · commit {sw['commit']}" if sw.get("commit") else ""),
        f"`{results.get('command', '')}` · {results['order']} · "
        f"{results.get('elapsed_s', 0) / 60:.1f} min",
        "",
        "Efficiency = same-run plain GEMM of the translator's shapes / the time taken (the "
        "whole translation: maps, k_norm, RoPE, cast, cache writes; in brackets the maps "
        f"alone; beside translation / target step, the GEMM's own share: its floor). Goals: efficiency >= {EFFICIENCY_GOAL:.0%} at "
        f"{' and '.join(map(str, EFFICIENCY_AT))} tokens on every pair; translation <= "
        f"{STEP_SHARE_GOAL:.0%} of a target decode step at 64 tokens on the Qwen3-shaped preset.",
        "",
        "| pair | n | translation ms | GEMM ms | efficiency (maps) | translation (GEMM) / target "
        "step | switch R/X | end-to-end R/(P+X) | source / target prefill |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["summary"]:
        goal = {True: " ✓", False: " ✗", None: ""}[row["efficiency_goal_met"]]
        lines.append(
            f"| {row['pair']} | {row['tokens']} | {row['translation_ms']:.2f} | "
            f"{row['gemm_ms']:.2f} | {100 * row['efficiency']:.0f}%{goal} "
            f"({100 * row['map_efficiency']:.0f}%) | "
            f"{100 * row['translation_vs_target_step']:.1f}% "
            f"({100 * row['gemm_vs_target_step']:.1f}%) | {row['switch_speedup']:.2f}x | "
            f"{row['end_to_end_speedup']:.2f}x | {100 * row['source_vs_target_prefill']:.0f}% |"
        )
    readings = {
        name: r.get("map_reading") for name, r in results["pairs"].items() if r.get("map_reading")
    }
    if readings:
        lines += ["", "Map reading chosen at load (map_reading.py), per kind and token count:", ""]
        for name, reading in readings.items():
            chosen = ", ".join(f"{k} {v['chosen']}" for k, v in reading.items())
            lines.append(f"- {name}: {chosen}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    plt = report.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in results["pairs"]:
        rows = [r for r in results["summary"] if r["pair"] == name]
        ns = [r["tokens"] for r in rows]
        a.plot(ns, [100 * r["efficiency"] for r in rows], marker="o", label=name)
        b.plot(ns, [100 * r["translation_vs_target_step"] for r in rows], marker="o", label=name)
    a.axhline(100 * EFFICIENCY_GOAL, color="grey", ls="--", lw=1)
    b.axhline(100 * STEP_SHARE_GOAL, color="grey", ls="--", lw=1)
    for ax, title in ((a, "translation vs same-run GEMM (%)"),
                      (b, "translation / one target decode step (%)")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens translated")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend(fontsize=7)
    fig.tight_layout()
    return report.save_figure(fig, path)


def write_outputs(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """side-by-side.{json,md,png} and each pair's own bench outputs in `out_dir/<pair>/`."""
    paths = report.output_files(
        out_dir, json="side-by-side.json", markdown="side-by-side.md", plot="side-by-side.png"
    )
    for name, r in results["pairs"].items():
        r.setdefault("command", results.get("command", ""))
        bench.write_outputs(r, Path(out_dir) / name.replace(">", "_to_").replace("/", "_"))
    report.write_json(results, paths["json"])
    paths["markdown"].write_text(markdown(results))
    if results["summary"]:
        plot(results, paths["plot"])
    else:
        del paths["plot"]
    return paths
