"""Longer stage 2 for a shipped demo translator, under a wall-clock budget.

Continues self-distillation from a translator file (default: the shipped default forward
translator) on chitchat training dialogues, evaluating the held-out KL and top-1 agreement
with the native target every `--eval-every` steps on the training file's own held-out split
(dialogues never trained on), keeping the best evaluation and stopping after `--patience`
evaluations without a new best or when `--minutes` run out. Writes the best translator and
the curve (json) to `--out` (default weights/stage2-runs/), as `--name`.safetensors (default:
the starting file's name + "-longer"); `add_translator` ships it.

    OPENBLAS_NUM_THREADS=1 python -m weights.build.stage2 --minutes 22

Steps `stage2_mixedtext` and `stage2_assistant` of `python -m weights.build.rebuild` run it from
`forward-mixing-nu2` (chat + documentation text) and then from that result (assistant mix).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.models.demo.pair import demo_data, demo_models, source_for, translator_path
from mlx_kvlingo.models.files import load_translator, save_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx

WEIGHTS = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--translator", default=None, help="start from this file (default: shipped)")
    ap.add_argument("--reverse", action="store_true", help="the backward direction")
    ap.add_argument("--minutes", type=float, default=22.0)
    ap.add_argument("--steps", type=int, default=400, help="schedule length (cosine to lr/10)")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--eval-examples", type=int, default=12)
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--skip", type=int, default=200, help="training examples used by stage 1")
    ap.add_argument("--data", type=Path, default=None, help="training data (default: chitchat)")
    ap.add_argument(
        "--heldout-data",
        type=Path,
        default=None,
        help="held-out examples for early stopping (default: --data's own 2%% split)",
    )
    ap.add_argument(
        "--reader-share",
        type=float,
        default=0.0,
        help="share of multi-turn examples trained with the reader mode's cache",
    )
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense")
    ap.add_argument("--out", type=Path, default=WEIGHTS / "stage2-runs")
    ap.add_argument("--name", default=None, help="output file stem (default: START-longer)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    start = args.translator or translator_path(reverse=args.reverse, pair=args.pair)
    folder = source_for(str(start), args.pair, args.reverse)  # the small model it reads
    src_dir, tgt_dir = demo_models(args.pair, folder)
    small, large = load_model(src_dir), load_model(tgt_dir)
    pair = load_pair(large, small) if args.reverse else load_pair(small, large)
    tr = load_translator(start, pair)
    data = args.data or demo_data()[0]
    dcfg = DataConfig(
        min_prefix=16,
        max_prefix=256,
        continuation=32,
        heldout_fraction=0.02,
        seed=0,
        reply_spans=args.reader_share > 0,
    )
    train, inner_held = load_examples(data, pair.tokenizer, dcfg)
    if args.heldout_data:
        hcfg = DataConfig(16, 256, 32, heldout_fraction=1.0, reply_spans=args.reader_share > 0)
        _, inner_held = load_examples(args.heldout_data, pair.tokenizer, hcfg)
        inner_held = random.Random(0).sample(inner_held, len(inner_held))
    cfg = Stage2Config(
        steps=args.steps, learning_rate=args.lr, warmup=max(args.steps // 40, 1),
        accumulate=args.accumulate, eval_every=args.eval_every, eval_examples=args.eval_examples,
        save_every=args.eval_every, patience=args.patience, max_seconds=args.minutes * 60, seed=1,
        reader_share=args.reader_share,
    )  # fmt: skip
    name = args.name or Path(start).stem + "-longer"
    t0 = time.perf_counter()
    with moe_cpu.per_expert_loop(args.pair == "moe"):  # MoE prefill as plain GEMMs on the CPU
        distill(tr, pair, train[args.skip :], inner_held, cfg, args.out / f"{name}-ckpt")
    s2 = tr.config.metadata["calibration"]["stage2"]
    s2["continued_from"] = Path(start).name
    s2["minutes"] = round((time.perf_counter() - t0) / 60, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    save_translator(tr, args.out / f"{name}.safetensors", pair, dtype=mx.float16)
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
             for k, v in vars(args).items() if v is not None and v is not False]  # fmt: skip
    record = {"command": "python -m weights.build.stage2 " + " ".join(flags), **s2}
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: s2[k] for k in ("steps", "stopped_early", "best", "minutes")}, indent=1))


if __name__ == "__main__":
    main()
