"""What the translator build step (translators.py) does to each fitted
translator: held-out figures after stage 1, stage 2 when asked for, held-out figures again, then
the float16 file and its manifest fields."""

from __future__ import annotations

import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.eval.evaluate import evaluate, table
from mlx_kvlingo.models.demo.smollm2 import sha256_of as sha256
from mlx_kvlingo.models.files import save_translator

import mlx.core as mx
from rich.console import Console

console = Console()


def evaluate_distill_save(tr, pair, label: str, stage2_train, inner_held, held, args, path: Path,
                          data: dict) -> dict:  # fmt: skip
    """`args`: steps, lr, accumulate (stage 2 runs when steps > 0). Returns the manifest fields
    the two scripts share: training data, stage-2 steps, held-out figures, sha256, bytes."""
    s1 = evaluate(pair, tr, held)
    console.print(table(s1, f"{label} after stage 1"))
    calibration = tr.config.metadata["calibration"]
    calibration["stage1"]["heldout"] = s1
    s2 = None
    if args.steps:
        t0 = time.perf_counter()
        cfg = Stage2Config(steps=args.steps, learning_rate=args.lr, warmup=max(args.steps // 10, 1),
                           accumulate=args.accumulate, eval_every=args.steps, eval_examples=8)  # fmt: skip
        distill(tr, pair, stage2_train, inner_held, cfg)
        s2 = evaluate(pair, tr, held)
        calibration["stage2"]["heldout"] = s2
        console.print(table(s2, f"{label} after stage 2 ({time.perf_counter() - t0:.0f} s)"))
    calibration["data"] = data
    save_translator(tr, path, pair, dtype=mx.float16)
    return {
        "training_data": data, "stage2_steps": args.steps,
        "heldout": {"stage1": s1, "stage2": s2}, "sha256": sha256(path),
        "bytes": path.stat().st_size,
    }  # fmt: skip
