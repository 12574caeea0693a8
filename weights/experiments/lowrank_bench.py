"""Low-rank vs full-rank translators on the demo pair: held-out quality and translation time,
side by side in one run, from one calibration pass (same data for every rank).

    python -m weights.experiments.lowrank_bench                    # r = 64, 128, 256 vs full, nu 1
    python -m weights.experiments.lowrank_bench --nu 2 --steps 30  # nu 2, then stage 2 for each
    python -m weights.experiments.lowrank_bench --help

Writes lowrank-results/lowrank.md and lowrank.json (and the translators, float32) under --out.
Time: median of interleaved repetitions of `translate` (map + k_norm/RoPE/cast, evaluated) on a
source span of each length, every translator in turn, so the machine's load hits all alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.closed_form import Stage1Config
from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.calibrate.lowrank import fit_lowrank_with_full
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.eval.evaluate import Scores, gap_recovered
from mlx_kvlingo.kv.capture import trace
from mlx_kvlingo.kv.lowrank import multiply_adds
from mlx_kvlingo.kv.scoring import native_logp, prepare, student_logp
from mlx_kvlingo.models.demo.pair import demo_data, demo_models
from mlx_kvlingo.models.files import load_translator, save_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import numpy as np


def evaluate_all(pair, translators: dict, examples) -> dict:
    """`kvlingo eval`'s metrics (same Scores) for every translator, the native target's and
    the source's passes shared: label -> summary, plus per-example KL for paired differences."""
    scores = {label: Scores.empty() for label in (*translators, "native", "source")}
    weights = []
    for ex in examples:
        prep = prepare(pair, ex, "post_norm")
        targets = mx.array(list(ex.continuation))
        scores["native"].add(prep.teacher_logp, prep.teacher_logp, targets)
        scores["source"].add(native_logp(pair.source, ex), prep.teacher_logp, targets)
        for label, tr in translators.items():
            scores[label].add(student_logp(tr, pair, prep), prep.teacher_logp, targets)
        weights.append(len(ex.continuation))
    out = {label: {**s.summary(weights), "kl_per_example": s.kl} for label, s in scores.items()}
    for label in translators:
        out[label]["gap_recovered"] = gap_recovered(
            out["source"]["nll"], out["native"]["nll"], out[label]["nll"]
        )
    return out


def paired(a: list, b: list, weights: list) -> tuple[float, float]:
    """Token-weighted mean of a - b over examples and its standard error."""
    d, w = np.subtract(a, b), np.asarray(weights, dtype=np.float64) / np.sum(weights)
    mean = float(d @ w)
    return mean, float(np.sqrt(np.sum(w**2 * (d - mean) ** 2)))


def timings(translators: dict, pair, tokens: list[int], lengths, repeats: int) -> dict:
    """label -> {length: median seconds of translate(span) + eval}."""
    spans = {n: trace(pair.source, tokens[:n], "post_norm") for n in lengths}
    times = {label: {n: [] for n in lengths} for label in translators}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for n, span in spans.items():
            for label, tr in translators.items():
                t0 = time.perf_counter()
                mx.eval(tr.translate(span, pair.target))
                times[label][n].append(time.perf_counter() - t0)
    return {lb: {n: statistics.median(v[1:]) for n, v in d.items()} for lb, d in times.items()}


def markdown(rows: list[dict], lengths, args) -> str:
    heads = " | ".join(f"translate {n} tok (ms)" for n in lengths)
    out = [
        f"# Low-rank translators, demo pair, nu {args.nu}",
        "",
        f"Command: `python -m weights.experiments.lowrank_bench {args.cmdline}`. Stage 1 from "
        f"{args.examples} chitchat training examples; held-out: {args.eval_examples} examples of "
        "chitchat-heldout.jsonl. KL and NLL in nats per continuation token. Times: median of "
        f"{args.repeats} interleaved repetitions in one run, ratio to full rank beside.",
        "",
        f"| translator | stage | mult-adds/token | KL | ΔKL vs full | NLL | agree | gap recovered "
        f"| {heads} |",
        "|---" * (8 + len(lengths)) + "|",
    ]
    for r in rows:
        full = next(x for x in rows if x["label"] == "full" and x["stage"] == r["stage"])
        t = " | ".join(
            f"{1e3 * r['time'][n]:.2f} ({r['time'][n] / full['time'][n]:.2f}x)" for n in lengths
        )
        e, (d, se) = r["heldout"], r["kl_vs_full"]
        out.append(
            f"| {r['label']} | {r['stage']} | {r['macs']:,} | {e['kl_native']:.4f} | "
            f"{d:+.4f} ± {se:.4f} | {e['nll']:.4f} | {e['agree_native']:.3f} | "
            f"{e['gap_recovered']:.3f} | {t} |"
        )
    r = rows[0]
    out += ["", f"Native target NLL {r['native']['nll']:.4f}, source alone NLL "
            f"{r['source']['nll']:.4f}. ΔKL: paired over the same examples, ± one standard error."]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="64,128,256")
    ap.add_argument("--nu", type=int, default=1)
    ap.add_argument("--examples", type=int, default=96, help="stage-1 examples")
    ap.add_argument("--selection-examples", type=int, default=32, help="for nu > 1")
    ap.add_argument("--eval-examples", type=int, default=24)
    ap.add_argument("--steps", type=int, default=0, help="stage-2 steps per translator")
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="lowrank-results")
    ap.add_argument("--stage1-from", help="load the stage-1 files an earlier run wrote in this "
                    "folder instead of fitting (same --nu, --ranks, --examples)")  # fmt: skip
    args = ap.parse_args(argv)
    args.cmdline = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
    )
    ranks = [int(r) for r in args.ranks.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src_dir, tgt_dir = demo_models()
    pair = load_pair(src_dir, tgt_dir)
    train_file, held_file = demo_data()
    # the shipped translators' data settings (weights/build/translators.py); templating stops
    # once the examples needed are drawn (the same first ones as a full load)
    need = args.examples + 2 * args.steps + 8
    dcfg = DataConfig(16, 256, 32, heldout_fraction=0.02, seed=0, max_examples=need, max_heldout=16)
    train, inner_held = load_examples(train_file, pair.tokenizer, dcfg)
    hcfg = DataConfig(16, 256, 32, 1.0, seed=0, max_heldout=args.eval_examples)
    _, held = load_examples(held_file, pair.tokenizer, hcfg)
    t0 = time.perf_counter()
    if args.stage1_from:
        folder = Path(args.stage1_from)
        full, *low = [
            load_translator(folder / f"demo-nu{args.nu}-{name}-stage1.safetensors", pair)
            for name in ["full", *(f"r{r}" for r in ranks)]
        ]
    else:
        cfg = Stage1Config(nu=args.nu, selection_examples=args.selection_examples)
        full, low = fit_lowrank_with_full(pair, train[: args.examples], ranks, cfg)
    print(
        f"stage 1, full rank and {len(ranks)} ranks: {time.perf_counter() - t0:.0f} s", flush=True
    )
    translators = {"full": full}
    for r, tr in zip(ranks, low):
        translators[
            f"r={r}" + (f" (clamped to {tr.config.rank})" if tr.config.rank < r else "")
        ] = tr
    stages = {"1": translators}
    if args.steps:
        s2 = {}
        for label, tr in translators.items():
            t1 = time.perf_counter()
            s2cfg = Stage2Config(steps=args.steps, learning_rate=3e-5,
                                 warmup=max(args.steps // 10, 1), accumulate=2,
                                 eval_every=args.steps, eval_examples=8)  # fmt: skip
            tr2 = type(tr)(replace(tr.config, metadata=copy.deepcopy(tr.config.metadata)))
            tr2.update(tr.parameters())
            s2[label] = distill(tr2, pair, train[args.examples :], inner_held, s2cfg)
            print(f"stage 2 {label}: {time.perf_counter() - t1:.0f} s", flush=True)
        stages["2"] = s2
    rows = []
    weights = [len(ex.continuation) for ex in held]
    for stage, trs in stages.items():
        t1 = time.perf_counter()
        results = evaluate_all(pair, trs, held)
        print(f"evaluation, stage {stage}: {time.perf_counter() - t1:.0f} s", flush=True)
        for label, tr in trs.items():
            e = results[label]
            name = label.split(" ")[0].replace("=", "")
            save_translator(tr, out / f"demo-nu{args.nu}-{name}-stage{stage}.safetensors", pair)
            delta = paired(e["kl_per_example"], results["full"]["kl_per_example"], weights)
            rows.append({"label": label, "stage": stage, "heldout": e, "kl_vs_full": delta,
                         "native": results["native"], "source": results["source"],
                         "macs": multiply_adds(tr.config)})  # fmt: skip
    tokens = [t for ex in held for t in ex.prefix + ex.continuation][: max(lengths)]
    for stage, trs in stages.items():
        times = timings(trs, pair, tokens, lengths, args.repeats)
        for r in rows:
            if r["stage"] == stage:
                r["time"] = times[r["label"]]
    (out / f"lowrank-nu{args.nu}.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows, lengths, args)
    (out / f"lowrank-nu{args.nu}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
