"""Build the MoE demo pair's translators (small source <-> SmolLM2-135M-MoE) and their report.

    python -m weights.build.moe_translators   # needs weights/moe/ (python -m weights.build.moe)

The same pipeline as translators.py (stage 1 closed form, then stage 2 self-distillation,
held-out chitchat dialogues never used for calibration), run for both key cuts: `post_norm`
(keys mapped after the target's k_norm, as mlx-lm caches them) and `pre_norm` (mapped before
it, the target's k_norm applied afterwards). Writes weights/translators/moe/*.safetensors,
the "moe" section of weights/manifest.json (other sections are left as they are) and the
held-out table as the "MoE pair" section of weights/QUALITY.md (between markers; the rest of
the file is left as it is). `--report-only` rewrites that section from the manifest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_many
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.models.demo.pair import demo_data, demo_models
from mlx_kvlingo.models.pair import load_model, load_pair

from rich.console import Console

from .manifest import merge_rows
from .quality_md import write_section
from .translator_build import evaluate_distill_save, sha256

WEIGHTS = Path(__file__).resolve().parents[1]
OUT = WEIGHTS / "translators" / "moe"
console = Console()


def build(name, pair, train, inner_held, held, variant, nu, cut, args) -> dict:
    label = f"{name}-{variant}-nu{nu}-{cut.replace('_', '')}"
    t0 = time.perf_counter()
    cfg = Stage1Config(variant=variant, nu=nu, key_cut=cut, selection_examples=args.selection_examples)  # fmt: skip
    (tr,) = fit_many(pair, train[: args.examples], [cfg])
    console.print(f"{label}: stage 1 in {time.perf_counter() - t0:.0f} s")
    path = OUT / f"{label}.safetensors"
    data = {"train": "chitchat-dataset (MIT), non-held-out dialogues", "examples": args.examples}
    done = evaluate_distill_save(tr, pair, label, train[args.examples :], inner_held, held, args,
                                 path, data)  # fmt: skip
    return {
        "file": f"moe/{path.name}", "direction": name, "variant": variant, "nu": nu,
        "key_cut": cut, "source": Path(pair.source.name).name,
        "target": Path(pair.target.name).name, **done,
    }  # fmt: skip


def score(row) -> float:
    r = row["heldout"]["stage2"] or row["heldout"]["stage1"]
    return -r["translated"]["kl_native"]


def quality_markdown(rows, command: str) -> str:
    lines = ["## MoE pair: held-out quality", "",
             f"Rebuild: `{command}`. Pair: the 8-layer demo source <-> SmolLM2-135M-MoE",
             "(qwen3_moe, 8 experts top-2, q/k norms; weights/moe/). Held-out chitchat dialogues,",
             "never used to heal either model or to calibrate. Columns as in QUALITY.md; key cut",
             "`post_norm` maps keys after the k_norm side's norm, `pre_norm` before it.", "",
             "| direction | variant | nu | key cut | stage | NLL native | NLL translated | NLL source alone | agree | KL | gap recovered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for stage in ("stage1", "stage2"):
            e = r["heldout"][stage]
            if not e:
                continue
            t = e["translated"]
            lines.append(
                f"| {r['direction']} | {r['variant']} | {r['nu']} | {r['key_cut']} | {stage[-1]} | "
                f"{e['native']['nll']:.3f} | {t['nll']:.3f} | {e['source']['nll']:.3f} | "
                f"{t['agree_native']:.3f} | {t['kl_native']:.3f} | {t['gap_recovered']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def row_from_file(f: Path) -> dict:
    """A manifest row from a saved translator's metadata (its calibration report)."""
    from mlx_kvlingo.models.files import read_metadata

    m = read_metadata(f)
    cal = m["calibration"]
    return {
        "file": f"moe/{f.name}", "direction": f.name.split("-")[0], "variant": m["variant"],
        "nu": len(m["key_layers"][0]), "key_cut": m["key_cut"],
        "source": Path(m["source"]["name"]).name, "target": Path(m["target"]["name"]).name,
        "training_data": cal.get("data"), "stage2_steps": (cal.get("stage2") or {}).get("steps"),
        "heldout": {"stage1": cal["stage1"].get("heldout"), "stage2": (cal.get("stage2") or {}).get("heldout")},
        "sha256": sha256(f), "bytes": f.stat().st_size,
    }  # fmt: skip


def write_manifest(path: Path, rows: list[dict], command: str, set_default: bool = False) -> None:
    """Merge `rows` into the manifest's "moe" part (by file; the dense pair's part, other rows and
    the defaults are kept unless `set_default`), then write QUALITY.md's MoE section."""
    best = {d: max((r for r in rows if r["direction"] == d), key=score, default=None)
            for d in ("forward", "backward")}  # fmt: skip
    best = {d: r and r["file"] for d, r in best.items()}
    pair = {"source": "SmolLM2-demo-source (weights/source)",
            "target": "SmolLM2-135M-MoE (weights/moe)"}  # fmt: skip
    manifest = merge_rows(path, rows, section="moe", fields={"pair": pair, "command": command},
                          default=best if set_default else None, initial_default=best,
                          demo_source="source")  # fmt: skip
    moe = manifest["moe"]
    write_section(WEIGHTS / "QUALITY.md", "moe-pair", quality_markdown(moe["translators"], command))
    console.print(f"defaults: {moe['default']}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--examples", type=int, default=160, help="stage-1 examples")
    ap.add_argument("--selection-examples", type=int, default=32)
    ap.add_argument("--eval-examples", type=int, default=40)
    ap.add_argument("--steps", type=int, default=24, help="stage-2 steps per configuration")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--variant", default="mixing")
    ap.add_argument("--nu", type=int, default=1)
    ap.add_argument("--cuts", default="post_norm,pre_norm")
    ap.add_argument("--directions", default="forward,backward")
    ap.add_argument("--report-only", action="store_true", help="rewrite QUALITY.md's section")
    ap.add_argument("--from-files", action="store_true",
                    help="rebuild the manifest section from the saved files' metadata")  # fmt: skip
    ap.add_argument("--set-default", action="store_true",
                    help="make the best rebuilt file per direction the default (else kept)")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    path = WEIGHTS / "manifest.json"
    if args.from_files:
        rows = [row_from_file(f) for f in sorted(OUT.glob("*.safetensors"))]
        command = json.loads(path.read_text()).get("moe", {}).get("command", "")
        write_manifest(path, rows, command, set_default=args.set_default)
        return
    if args.report_only:
        m = json.loads(path.read_text())["moe"]
        write_section(
            WEIGHTS / "QUALITY.md", "moe-pair", quality_markdown(m["translators"], m["command"])
        )
        return
    OUT.mkdir(parents=True, exist_ok=True)
    src_dir, tgt_dir = demo_models("moe", "source")  # the 8-layer source (weights/source/)
    small, large = load_model(src_dir), load_model(tgt_dir)
    train_file, held_file = demo_data()
    rows = []
    with moe_cpu.per_expert_loop():  # MoE prefill as plain GEMMs on the CPU (same function)
        for name in args.directions.split(","):
            pair = load_pair(small, large) if name == "forward" else load_pair(large, small)
            dcfg = DataConfig(16, 256, 32, heldout_fraction=0.02, seed=0)
            train, inner_held = load_examples(train_file, pair.tokenizer, dcfg)
            _, held = load_examples(held_file, pair.tokenizer, DataConfig(16, 256, 32, 1.0, seed=0))
            for cut in args.cuts.split(","):
                rows.append(build(name, pair, train, inner_held, held[: args.eval_examples],
                                  args.variant, args.nu, cut, args))  # fmt: skip
    command = "python -m weights.build.moe_translators " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "set_default"
    )
    write_manifest(path, rows, command, set_default=args.set_default)


if __name__ == "__main__":
    main()
