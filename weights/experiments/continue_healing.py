"""Continue the demo source's healing where the `source` step stopped, and measure whether it helps.

weights/build/source.py planned 260 steps (batch 2, 256 tokens, lr 3e-4, cosine to lr/10) and its time
cap stopped it after 145 (weights/source/source.json). This script starts from the shipped
source exactly as the demo assembles it (8-bit layers, dequantized to float32), continues the
*same* schedule and the same window order from step steps_done + 1 (fresh AdamW moments, the
first few steps at a short linear ramp so they do not jolt the weights), and reports the
held-out perplexity (the 32 held-out windows of source.json) every --eval-every steps. It
writes the curve to --out/healing_curve.json; it does not replace weights/source/ (a new
source would invalidate every shipped translator). It needs the 8-layer `weights/source/`, which
is not in the tree: `python -m weights.build.rebuild --only source` rebuilds it.

    OPENBLAS_NUM_THREADS=1 python -m weights.experiments.continue_healing --max-minutes 25
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.models.demo import smollm2

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np

from ..build import source as bs

WEIGHTS = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-minutes", type=float, default=25.0)
    ap.add_argument("--eval-every", type=int, default=23)
    ap.add_argument("--ramp", type=int, default=5, help="steps of linear ramp for fresh moments")
    ap.add_argument("--out", type=Path, default=WEIGHTS / "curves")
    ap.add_argument(
        "--save",
        type=Path,
        default=None,
        help="also write the continued source here (the source step's layout)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    record = json.loads((WEIGHTS / "source" / "source.json").read_text())
    tr = record["training"]
    done, total = tr["steps_done"], tr["steps"]

    target_dir = smollm2.ensure_smollm2(dequantize=True)
    teacher, tokenizer, _ = mlx_lm.load(str(target_dir), return_config=True)
    teacher.freeze()
    student, _ = mlx_lm.load(str(smollm2.ensure_demo_source(dequantize=True, folder="source")))
    student.freeze()
    for layer in student.model.layers:
        layer.unfreeze()
    student.model.norm.unfreeze()
    win = argparse.Namespace(seq_len=tr["seq_len"], eval_windows=32, select_windows=8)
    train, _, heldout = bs.load_windows(tokenizer, win)
    order = np.random.default_rng(tr["seed"]).permutation(len(train))

    base = bs.lr_schedule(tr["lr"], total, tr["warmup"])
    lr_at = lambda s: base(s) * min(1.0, (s - done) / args.ramp)  # noqa: E731
    opt = optim.AdamW(learning_rate=tr["lr"], weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(student, bs.kl_loss)
    t0 = time.time()
    curve = [{"step": done, "heldout_ppl": round(math.exp(bs.mean_nll(student, heldout)), 3)}]
    print(curve[-1], flush=True)
    losses = []
    for step in range(done + 1, total + 1):
        opt.learning_rate = mx.array(lr_at(step - 1))  # the schedule the source step used
        idx = order[(step - 1) * tr["batch"] : step * tr["batch"]]
        x = mx.array(train[idx])[:, :-1]
        loss, grads = loss_and_grad(student, x, mx.stop_gradient(teacher(x)))
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state, loss)
        losses.append(loss.item())
        out_of_time = time.time() - t0 > args.max_minutes * 60
        if (step - done) % args.eval_every == 0 or step == total or out_of_time:
            ppl = math.exp(bs.mean_nll(student, heldout))
            curve.append({"step": step, "heldout_ppl": round(ppl, 3),
                          "train_kl_mean": round(float(np.mean(losses)), 4),
                          "minutes": round((time.time() - t0) / 60, 1)})  # fmt: skip
            losses = []
            print(curve[-1], flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            result = {"command": "OPENBLAS_NUM_THREADS=1 python -m weights.experiments.continue_healing "
                      f"--max-minutes {args.max_minutes:g} --eval-every {args.eval_every}",
                      "target_ppl": record["heldout_perplexity"]["target"],
                      "shipped_source_ppl": record["heldout_perplexity"]["source_healed"],
                      "planned_steps": total, "curve": curve}  # fmt: skip
            (args.out / "healing_curve.json").write_text(json.dumps(result, indent=1))
        if out_of_time:
            print(f"time budget reached after step {step}", flush=True)
            break
    if args.save:  # a new source: every translator would need calibrating again
        bs.save_layers(student, args.save)
        tr["steps_done"] = step
        tr["continued"] = {"from_step": done, "curve": curve}
        ppl = record["heldout_perplexity"]
        ppl["source_healed_float32"] = curve[-1]["heldout_ppl"]
        kept = record.pop("kept_layers")
        bs.save_record(args.save, kept, record)
        # measured as ensure_demo_source() assembles it (8-bit layers): what source.json ships
        ppl["source_healed"] = round(math.exp(bs.shipped_nll(args.save, heldout)), 2)
        bs.save_record(args.save, kept, record)
        print(
            f"saved {args.save}: held-out perplexity as shipped {ppl['source_healed']}", flush=True
        )


if __name__ == "__main__":
    main()
