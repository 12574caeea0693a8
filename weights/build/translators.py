"""Build the demo pair's translators (both directions) and their quality report.

    python -m weights.build.translators    # ~50 min on a 2-core CPU (step `translators`)

Stage 1 (closed form) for headwise and mixing, nu in {1, 2}, from one pass over chitchat
training dialogues; each is evaluated on held-out dialogues (never seen by the source's
healing nor by calibration); stage 2 (self-distillation) then continues each configuration.
Writes weights/translators/*.safetensors (float16), their rows of weights/manifest.json (merged:
the MoE part, other rows and the defaults stay unless `--set-default`) and weights/QUALITY.md's
section.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_many
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.models.demo.pair import demo_data, demo_models
from mlx_kvlingo.models.pair import load_model, load_pair

from rich.console import Console

from .manifest import merge_rows
from .quality_md import write_section
from .translator_build import evaluate_distill_save

WEIGHTS = Path(__file__).resolve().parents[1]
OUT = WEIGHTS / "translators"
GRID = [("mixing", 1), ("headwise", 1), ("mixing", 2), ("headwise", 2)]
console = Console()


def build_direction(name, pair, train, inner_held, held, args) -> list[dict]:
    t0 = time.perf_counter()
    cfgs = [
        Stage1Config(variant=v, nu=nu, selection_examples=args.selection_examples) for v, nu in GRID
    ]
    translators = fit_many(pair, train[: args.examples], cfgs)
    console.print(f"[{name}] stage 1 for {len(GRID)} configs: {time.perf_counter() - t0:.0f} s")
    rows = []
    for (variant, nu), tr in zip(GRID, translators):
        label = f"{name}-{variant}-nu{nu}"
        path = OUT / f"{label}.safetensors"
        data = {
            "train": "chitchat-dataset (MIT), non-held-out dialogues",
            "examples": args.examples,
        }
        done = evaluate_distill_save(tr, pair, label, train[args.examples :], inner_held, held,
                                     args, path, data)  # fmt: skip
        rows.append({
            "file": path.name, "direction": name, "variant": variant, "nu": nu, "key_cut": "post_norm",
            "source": Path(pair.source.name).name, "target": Path(pair.target.name).name, **done,
        })  # fmt: skip
    return rows


def score(row) -> float:
    r = row["heldout"]["stage2"] or row["heldout"]["stage1"]
    return -r["translated"]["kl_native"]


def quality_markdown(rows) -> str:
    lines = ["# Demo translators: held-out quality", "",
             "Rebuild: `python -m weights.build.translators`. Held-out chitchat dialogues (1 in 20 by id",
             "hash), never used to heal the source or to calibrate. NLL per token of the continuation",
             "(the next assistant reply) as scored by the target; agree = top-1 equal to the target's",
             "own with its native cache; gap recovered = (NLL_source_alone - NLL) / (NLL_source_alone - NLL_native).",
             "",
             "| direction | variant | nu | stage | NLL native | NLL translated | NLL raw | NLL source alone | agree | KL | gap recovered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for stage in ("stage1", "stage2"):
            e = r["heldout"][stage]
            if not e:
                continue
            raw = e["raw"].get("nll")
            lines.append(
                f"| {r['direction']} | {r['variant']} | {r['nu']} | {stage[-1]} | {e['native']['nll']:.3f} | "
                f"{e['translated']['nll']:.3f} | {'n/a' if raw is None else f'{raw:.3f}'} | "
                f"{e['source']['nll']:.3f} | {e['translated']['agree_native']:.3f} | "
                f"{e['translated']['kl_native']:.3f} | {e['translated']['gap_recovered']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def write_manifest(path: Path, rows: list[dict], command: str, set_default: bool = False) -> dict:
    """Merge the dense pair's rebuilt `rows` into the manifest at `path`: the "moe" part, rows
    for files not rebuilt and the defaults are kept; with `set_default`, each direction's
    lowest held-out KL among `rows` becomes its default (it also fills a direction with none)."""
    best = {d: max((r for r in rows if r["direction"] == d), key=score, default=None)
            for d in ("forward", "backward")}  # fmt: skip
    best = {d: r and r["file"] for d, r in best.items()}
    pair = {"source": "SmolLM2-demo-source (weights/source)", "target": "SmolLM2-135M-Instruct"}
    return merge_rows(path, rows, fields={"pair": pair, "command": command},
                      default=best if set_default else None, initial_default=best,
                      demo_source="source")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--examples", type=int, default=240, help="stage-1 examples")
    ap.add_argument("--selection-examples", type=int, default=48)
    ap.add_argument("--eval-examples", type=int, default=48)
    ap.add_argument("--steps", type=int, default=60, help="stage-2 steps per configuration")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--directions", default="forward,backward")
    ap.add_argument("--set-default", action="store_true",
                    help="make the best rebuilt file per direction the default (else kept)")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    src_dir, tgt_dir = demo_models("dense", "source")  # the 8-layer source (weights/source/)
    small, large = load_model(src_dir), load_model(tgt_dir)
    train_file, held_file = demo_data()
    rows = []
    for name in args.directions.split(","):
        pair = load_pair(small, large) if name == "forward" else load_pair(large, small)
        dcfg = DataConfig(
            min_prefix=16, max_prefix=256, continuation=32, heldout_fraction=0.02, seed=0
        )
        train, inner_held = load_examples(train_file, pair.tokenizer, dcfg)
        _, held = load_examples(held_file, pair.tokenizer, DataConfig(16, 256, 32, 1.0, seed=0))
        rows += build_direction(name, pair, train, inner_held, held[: args.eval_examples], args)
    command = "python -m weights.build.translators " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "set_default"
    )
    manifest = write_manifest(
        WEIGHTS / "manifest.json", rows, command, set_default=args.set_default
    )
    write_section(WEIGHTS / "QUALITY.md", "demo-pair", quality_markdown(rows), first=True)
    console.print(f"defaults: {manifest['default']}")


if __name__ == "__main__":
    main()
