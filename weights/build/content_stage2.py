"""Stage 2 on content examples for a shipped demo translator, through `kvlingo calibrate`.

Continues from `--init` on the set `kvlingo calibrate` builds without `--data` (or on `--data`):
ordinary examples from the shipped text and content tasks over it (facts, copies, questions, summaries)
answered by the target on its own cache, with the K/V term (`--kv-weight`, KV Prediction's
cache loss) that holds the continuation figures. The held-out best (KL on held-out content and
ordinary examples together) is written to `--out`/`--name`.safetensors; the checkpoints and
the target's cached answers go beside it, so an interrupted run resumes.

    OPENBLAS_NUM_THREADS=1 python -m weights.build.content_stage2 --init FILE

(`python -m weights.build.rebuild --list`: the steps that run it, with their `--init`.)

Why these settings: weights/QUALITY.md, "Training the maps on the target's answers".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.models.demo.pair import demo_models, source_for

import click

WEIGHTS = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--init", type=Path, required=True, help="the translator to continue from")
    ap.add_argument("--content", type=int, default=256, help="content examples")
    ap.add_argument("--content-lengths", default="128,256")
    ap.add_argument("--ordinary", type=int, default=256, help="ordinary examples")
    ap.add_argument("--data", type=Path, default=None,
                    help="the ordinary examples' text (and the content tasks'), as kvlingo "
                         "calibrate --data; default: the shipped text")  # fmt: skip
    ap.add_argument(
        "--reader-share",
        type=float,
        default=0.0,
        help="share of multi-turn chats trained as the reader mode builds them",
    )
    ap.add_argument("--source", type=Path, default=None,
                    help="the source model folder; default: the demo source")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="which examples and tasks are drawn")
    ap.add_argument("--kv-weight", type=float, default=1.0)
    ap.add_argument("--gain-weights", action="store_true",
                    help="weight the loss by the prefix gain (scoring.prefix_gain); the shipped "
                         "runs had it off")  # fmt: skip
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--out", type=Path, default=WEIGHTS / "stage2-runs")
    ap.add_argument("--name", default="forward-mixing-nu2-content")
    return ap


def calibrate_args(a: argparse.Namespace) -> list[str]:
    """The `kvlingo calibrate` command line this step runs."""
    source, target = demo_models("dense", source_for(str(a.init), "dense"))
    source = a.source or source
    return ["--source", str(source), "--target", str(target), "--init", str(a.init),
            "--max-examples", str(a.ordinary), "--content", str(a.content),
            "--content-lengths", a.content_lengths,
            "--gain-weights" if a.gain_weights else "--no-gain-weights",
            "--kv-weight", str(a.kv_weight), "--steps", str(a.steps), "--accumulate", "1",
            "--lr", str(a.lr), "--warmup", str(a.warmup), "--eval-every", str(a.eval_every),
            "--eval-examples", "16", "--seed", str(a.seed), "--checkpoint-dir", str(a.out / f"{a.name}-checkpoints"),
            "-o", str(a.out / f"{a.name}.safetensors"),
            *(["--data", str(a.data)] if a.data else []),
            *(["--reader-share", str(a.reader_share)] if a.reader_share else [])]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from mlx_kvlingo.cli.calibrate import calibrate_cmd

    a = parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        calibrate_cmd.main(args=calibrate_args(a), standalone_mode=False)
    except click.ClickException as e:  # an interruption, bad data: its message, not a traceback
        e.show()
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main()
