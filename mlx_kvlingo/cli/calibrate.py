"""`kvlingo calibrate`: stage 1 (closed form) then stage 2 (self-distillation) for a pair."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click
from rich.console import Console

from ..calibrate.closed_form import Stage1Config, fit_closed_form
from ..calibrate.distill import Stage2Config, TrainingDivergedError, distill
from ..calibrate.lowrank import fit_lowrank
from ..data import DataError, load_examples, validate_data
from ..format import load_translator, save_translator
from ..measure.evaluate import evaluate, table
from ..pair import InsufficientMemoryError, TokenizerMismatchError, load_pair
from ._common import data_config, data_options


@click.command("calibrate")
@click.option("--source", required=True, help="Source model (reads the prompt)")
@click.option("--target", required=True, help="Target model (decodes)")
@data_options
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--variant", type=click.Choice(["mixing", "headwise"]), default="mixing", show_default=True
)
@click.option("--rank", type=click.IntRange(min=1),
              help="Low-rank translator: a shared code of RANK numbers per source layer (keys and "
                   "values each), decoded per target layer; fitted from the mixing maps, clamped "
                   "to the source's per-layer K/V width. Fewer FLOPs only at small RANK: see mlx_kvlingo/calibrate/README.md")  # fmt: skip
@click.option("--nu", default=1, show_default=True, help="Source layers read per target layer")
@click.option(
    "--key-cut",
    type=click.Choice(["post_norm", "pre_norm"]),
    default="post_norm",
    show_default=True,
)
@click.option(
    "--bias/--no-bias", default=True, show_default=True, help="Center inputs and fit a bias"
)
@click.option(
    "--native-first/--no-native-first",
    default=True,
    show_default=True,
    help="Keep the target's own K/V for the first token (an attention sink; computed once)",
)
@click.option("--alpha", default=1e-3, show_default=True,
              help="Stage-1 ridge strength, relative to the inputs' mean variance: lambda = alpha * "
                   "trace(Cov(X)) / d. It shrinks the maps (1e-3 moves a known-answer pair's "
                   "first-layer maps by ~5%); the report gives the training fit at alpha 0 beside it")  # fmt: skip
@click.option("--prior", default="zero", show_default=True,
              help="What the stage-1 ridge shrinks toward: zero, identity (same KV heads and head "
                   "sizes: the nearest-by-depth layer copied) or a translator file (e.g. a related "
                   "pair's fit)")  # fmt: skip
@click.option("--alpha-grid", default=None,
              help="Comma-separated alphas; each target layer and kind takes the one with the "
                   "lowest residual on held-out calibration documents (overrides --alpha)")  # fmt: skip
@click.option("--patience", type=int, default=None,
              help="Stop stage 2 after this many held-out evaluations without a new best (the "
                   "best evaluated translator is what is written in any case)")  # fmt: skip
@click.option("--reader-share", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of multi-turn chat examples trained as the reader mode builds the "
                   "cache: earlier replies read by the target itself, the rest translated")  # fmt: skip
@click.option(
    "--layer-map", type=click.Path(exists=True), help="JSON {key: [[...]...], value: [[...]...]}"
)
@click.option(
    "--init", type=click.Path(exists=True), help="Start stage 2 from this translator (skip stage 1)"
)
@click.option("--steps", default=Stage2Config.steps, show_default=True,
              help="Stage-2 (self-distillation) steps after stage 1; 0: stage 1 only")  # fmt: skip
@click.option("--lr", default=1e-4, show_default=True)
@click.option("--warmup", default=10, show_default=True)
@click.option("--accumulate", default=1, show_default=True)
@click.option("--grad-clip", default=1.0, show_default=True)
@click.option("--eval-every", default=25, show_default=True)
@click.option("--eval-examples", default=32, show_default=True)
@click.option("--checkpoint-dir", type=click.Path(file_okay=False))
@click.option("--resume/--no-resume", default=True, show_default=True)
def calibrate_cmd(source, target, output, variant, rank, nu, key_cut, bias, native_first, alpha, prior,
                  alpha_grid, patience, reader_share, layer_map, init, steps, lr, warmup, accumulate, grad_clip,
                  eval_every, eval_examples, checkpoint_dir, resume, **kw):  # fmt: skip
    """Fit a translator SOURCE -> TARGET on your data; swap the two for the other direction."""
    console = Console(stderr=True)
    if rank is not None and (variant != "mixing" or init):
        raise click.ClickException(
            "--rank fits a low-rank translator from the mixing maps: it goes with "
            "--variant mixing and without --init"
        )
    try:
        validate_data(kw["data_path"])  # before loading any model
        pair = load_pair(source, target)
        dcfg = replace(data_config(kw), reply_spans=reader_share > 0)
        train, held = load_examples(kw["data_path"], pair.tokenizer, dcfg)
    except (TokenizerMismatchError, DataError, InsufficientMemoryError) as e:
        raise click.ClickException(str(e)) from None
    console.print(f"{len(train)} training and {len(held)} held-out examples from {kw['data_path']}")
    held_eval = held[:eval_examples]
    report = {"data": str(kw["data_path"]), "data_config": dcfg.__dict__}
    if init:
        tr = load_translator(init, pair)
    else:
        maps = json.loads(Path(layer_map).read_text()) if layer_map else {}
        try:
            grid = tuple(float(a) for a in alpha_grid.split(",")) if alpha_grid else None
            cfg = Stage1Config(
                variant, nu, key_cut, bias, native_first, alpha, maps.get("key"), maps.get("value"),
                prior=prior, alpha_grid=grid,
            )  # fmt: skip
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        tr = (
            fit_closed_form(pair, train, cfg)
            if rank is None
            else fit_lowrank(pair, train, [rank], cfg)[0]
        )
    cal = tr.config.metadata.setdefault("calibration", {})
    cal.update(report)
    if not init:
        console.print(fit_line(cal["stage1"]))
    if held_eval and not init:
        result = evaluate(pair, tr, held_eval)
        cal["stage1"]["heldout"] = result
        console.print(table(result, "after stage 1"))
    if steps:
        s2 = Stage2Config(steps, lr, warmup, 0.0, grad_clip, accumulate, eval_every, min(16, eval_examples),
                          seed=kw["seed"], patience=patience, reader_share=reader_share)  # fmt: skip
        try:
            distill(tr, pair, train, held, s2, checkpoint_dir, resume)
        except KeyboardInterrupt:
            raise click.ClickException(
                f"interrupted; checkpoint kept in {checkpoint_dir}"
            ) from None
        except TrainingDivergedError as e:
            raise click.ClickException(str(e)) from None
        if held_eval:
            result = evaluate(pair, tr, held_eval)
            cal["stage2"]["heldout"] = result
            console.print(table(result, "after stage 2"))
    save_translator(tr, output, pair)
    console.print(f"wrote {output}")


def fit_line(stage1: dict) -> str:
    """Stage 1's training fit at the chosen alpha, with the unregularized fit beside it."""
    parts = []
    for kind, r in stage1.get("train_fit", {}).items():
        parts.append(
            f"{kind} R² {r['r2_mean']:.4f} (alpha 0: {r.get('r2_mean_alpha0', r['r2_mean']):.4f})"
        )
    return f"stage 1 fit on training data, alpha {stage1.get('alpha')}: " + " · ".join(parts)
