"""`kvlingo calibrate`: stage 1 (closed form) then stage 2 (self-distillation) for a pair."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from statistics import fmean

from mlx_kvlingo.cli._common import content_texts, data_options, progress_bar
from mlx_kvlingo.cli._params import ModelSpec, NumberList, OutputFile, OutputFolder
from mlx_kvlingo.data.examples import load_examples, validate_data

import click
import mlx.core as mx
from rich.console import Console


@click.command("calibrate", context_settings={"show_default": True})
@click.option("--source", required=True, type=ModelSpec(), help="Source model (reads the prompt)")
@click.option("--target", required=True, type=ModelSpec(), help="Target model (decodes)")
@click.option("--dtype", type=click.Choice(["auto", "stored", "float32", "float16", "bfloat16"]),
              default="auto",
              help="What the models compute in (auto: float32 on a CPU, as stored on a GPU; stored: the "
              "checkpoint's weights as they are, 4- or 8-bit quantized included, as Metal runs them)")  # fmt: skip
@data_options(
    help="Text files, JSONL records ({'messages': [...]} chats or {'text': ...}) or a folder of "
    "them; default: text every install has (CPython's documentation topics, the chitchat "
    "dialogues) plus content tasks over it answered by the target itself",
)
@click.option("--content", "content_n", type=click.IntRange(min=0),
              help="Content examples for stage 2: prompts whose answer is only in the text read "
                   "(facts, copies, questions, summaries), answered by the target on its own "
                   "cache; default 0 with --data, 240 without")  # fmt: skip
@click.option("--content-lengths", type=NumberList(int, 32), default="128,256,512",
              help="Prompt lengths of the content examples, in tokens")  # fmt: skip
@click.option("--gain-weights/--no-gain-weights", default=None,
              help="Weight stage 2's loss by how much the prefix changes the target's "
                   "prediction of each token; default on without --data")  # fmt: skip
@click.option("--kv-weight", type=click.FloatRange(min=0), default=0.0,
              help="Add this times the relative L1 error between the translated and the "
                   "target's own K/V to stage 2's loss (KV Prediction's cache term)")  # fmt: skip
@click.option("-o", "--output", required=True, type=OutputFile())
@click.option("--variant", type=click.Choice(["mixing", "headwise"]), default="mixing")
@click.option("--nu", type=click.IntRange(1), default=1, help="Source layers read per target layer")
@click.option("--key-cut", type=click.Choice(["post_norm", "pre_norm"]), default="post_norm")
@click.option("--bias/--no-bias", default=True, help="Center inputs and fit a bias")
@click.option("--alpha", type=click.FloatRange(0), default=1e-3,
              help="Stage-1 ridge strength, relative to the inputs' mean variance: lambda = alpha * "
                   "trace(Cov(X)) / d; the report gives the training fit at alpha 0 beside it")  # fmt: skip
@click.option("--prior", default="zero",
              help="What the stage-1 ridge shrinks toward: zero, identity (same KV heads and head "
                   "sizes: the nearest-by-depth layer copied) or a translator file (e.g. a related "
                   "pair's fit)")  # fmt: skip
@click.option("--alpha-grid", type=NumberList(float, 0),
              help="Comma-separated alphas; each target layer and kind takes the one with the "
                   "lowest residual on held-out calibration documents (overrides --alpha)")  # fmt: skip
@click.option("--patience", type=click.IntRange(1),
              help="Stop stage 2 after this many held-out evaluations without a new best (the "
                   "best evaluated translator is what is written in any case)")  # fmt: skip
@click.option("--reader-share", type=click.FloatRange(0, 1), default=0.0,
              help="Share of multi-turn chat examples trained as the reader mode builds the "
                   "cache: earlier replies read by the target itself, the rest translated")  # fmt: skip
@click.option("--layer-map", type=click.Path(exists=True),
              help="JSON {key: [[...]...], value: [[...]...]}")  # fmt: skip
@click.option("--init", type=click.Path(exists=True),
              help="Start stage 2 from this translator (skip stage 1)")  # fmt: skip
@click.option("--steps", type=click.IntRange(0), default=100,
              help="Stage-2 (self-distillation) steps after stage 1; 0: stage 1 only")  # fmt: skip
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=1e-4)
@click.option("--warmup", type=click.IntRange(0), default=10)
@click.option("--accumulate", type=click.IntRange(1), default=1)
@click.option("--eval-every", type=click.IntRange(1), default=25)
@click.option("--eval-examples", type=click.IntRange(0), default=32)
@click.option("--checkpoint-dir", type=OutputFolder())
@click.option("--resume/--no-resume", default=True)
def calibrate_cmd(source, target, content_n, content_lengths, gain_weights, kv_weight, output, variant, nu,
                  key_cut, bias, alpha, prior, alpha_grid, patience, reader_share, layer_map,
                  init, steps, lr, warmup, accumulate, eval_every, eval_examples,
                  checkpoint_dir, resume, dtype, data_path, data):  # fmt: skip
    """Fit a translator SOURCE -> TARGET (on your data, or with none); swap the two for the
    other direction."""
    from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_closed_form
    from mlx_kvlingo.calibrate.distill import Stage2Config, distill
    from mlx_kvlingo.eval.evaluate import evaluate, table
    from mlx_kvlingo.models.files import save_translator
    from mlx_kvlingo.models.loading import load_models_and_translators

    console = Console(stderr=True)
    no_data = data_path is None
    content_n = (240 if no_data else 0) if content_n is None else content_n
    gain_weights = no_data if gain_weights is None else gain_weights
    if no_data:  # a long run: resumable by default
        from mlx_kvlingo.calibrate.content_data import write_shipped_data

        checkpoint_dir = checkpoint_dir or str(Path(output).with_suffix("")) + ".ckpt"
        data_path = str(write_shipped_data())
    validate_data(data_path)  # before loading any model
    dtype = {"auto": "auto", "stored": None}.get(dtype, getattr(mx, dtype, None))
    pair, init_tr, _ = load_models_and_translators(source, target, init, dtype=dtype)
    dcfg = replace(data, reply_spans=reader_share > 0)
    train, held = load_examples(data_path, pair.tokenizer, dcfg)
    console.print(f"{len(train)} training and {len(held)} held-out examples from {data_path}")
    content = []
    if content_n or no_data:
        content, held_content = _content_examples(
            pair, console, content_n, content_lengths, data.seed, checkpoint_dir, steps,
            accumulate, [] if init else train, train, held, None if no_data else data_path,
        )  # fmt: skip
        # stage 2's early stopping sees content too: a held-out KL of generic text alone
        # would keep the translator that drops what was read
        held = [x for pair_ in zip(held_content, held) for x in pair_] + held[len(held_content) :]
    held_eval = held[:eval_examples]
    if init:
        tr = init_tr
    else:
        maps = json.loads(Path(layer_map).read_text()) if layer_map else {}
        try:
            cfg = Stage1Config(
                variant, nu, key_cut, bias, alpha=alpha, key_layers=maps.get("key"),
                value_layers=maps.get("value"), prior=prior, alpha_grid=alpha_grid,
            )  # fmt: skip
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        with progress_bar("stage 1: accumulating", console) as progress:
            tr = fit_closed_form(pair, train, cfg, progress)
    cal = tr.config.metadata.setdefault("calibration", {})
    cal.update(data=str(data_path), data_config=dcfg.__dict__)

    def heldout(stage: int) -> None:  # the held-out scores after `stage`, into the metadata
        if held_eval:
            with progress_bar("evaluating", console) as progress:
                cal[f"stage{stage}"]["heldout"] = result = evaluate(pair, tr, held_eval, progress)
            console.print(table(result, f"after stage {stage}"))

    if not init:  # stage 1's training fit at the chosen alpha, the unregularized one beside it
        s1 = cal["stage1"]
        fits = [f"{kind} R² {r['r2_mean']:.4f} (alpha 0: {r.get('r2_mean_alpha0', r['r2_mean']):.4f})"
                for kind, r in s1.get("train_fit", {}).items()]  # fmt: skip
        console.print(f"stage 1 fit on training data, alpha {s1.get('alpha')}: " + " · ".join(fits))
        heldout(1)
    if steps:
        s2 = Stage2Config(steps, lr, warmup, accumulate=accumulate, eval_every=eval_every,
                          eval_examples=min(16, eval_examples), seed=data.seed, patience=patience,
                          reader_share=reader_share, gain_weights=gain_weights, kv_weight=kv_weight)  # fmt: skip
        try:
            with progress_bar("stage 2", console) as progress:
                distill(tr, pair, list(train) + content, held, s2, checkpoint_dir, resume,
                        progress=progress)  # fmt: skip
        except KeyboardInterrupt:
            raise click.ClickException(
                f"interrupted; checkpoint kept in {checkpoint_dir}"
            ) from None
        heldout(2)
    save_translator(tr, output, pair)
    console.print(f"wrote {output}")
    if no_data:  # what the user got: can the target use what the source read?
        _content_report(pair, tr, console)


def _content_examples(pair, console, n, lengths, seed, checkpoint_dir, steps, accumulate, stage1,
                      train, held, data_path) -> tuple[list, list]:  # fmt: skip
    """The plan, then `n` training and n/10 held-out content examples answered by the target
    (cached for a resume), over `data_path`'s text or the shipped text."""
    from mlx_kvlingo.calibrate.content_data import content_examples, shipped_texts, unanswered
    from mlx_kvlingo.calibrate.plan import CalibrationPlan, measure_rates, probe_peak
    from mlx_kvlingo.data.examples import read_texts

    longest = max(train, key=lambda e: len(e.prefix) + len(e.continuation))
    peak = probe_peak(lambda: pair.target.model(mx.array(list(longest.prefix) * 2)[None]))
    plan = CalibrationPlan(len(stage1), len(train), len(held), n, steps, accumulate,
                           fmean(len(e.prefix) for e in train), fmean(lengths), measure_rates(pair),
                           int(1.2 * peak))  # fmt: skip
    cache = Path(checkpoint_dir) / "content-answers.jsonl" if checkpoint_dir else None
    texts = shipped_texts() if data_path is None else read_texts(data_path)
    n_held = max(4, n // 10) if n else 0
    plan.content_to_answer = unanswered(pair, texts, n, lengths, seed=seed, cache_file=cache) + (
        unanswered(pair, texts, n_held, lengths, seed=seed + 1000, cache_file=cache))  # fmt: skip
    console.print(plan.describe())
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("content answers (target, native)", console) as progress:
        out = content_examples(pair, texts, n, lengths, seed=seed, cache_file=cache,
                               on_example=lambda k: progress(k, n + n_held))  # fmt: skip
        held_out = content_examples(pair, texts, n_held, lengths, seed=seed + 1000,
                                    cache_file=cache,
                                    on_example=lambda k: progress(n + k, n + n_held))  # fmt: skip
    console.print(f"{len(out)} training and {len(held_out)} held-out content examples "
                  f"(answers cached in {cache})")  # fmt: skip
    return out, held_out


def _content_report(pair, tr, console) -> None:
    from mlx_kvlingo.data.content_tasks import build_tasks
    from mlx_kvlingo.eval.content import evaluate_content, tables, to_json

    tasks = build_tasks(pair.tokenizer, content_texts(None), (128, 512), 3, seed=1)
    with progress_bar("content", console) as progress:
        result = to_json(evaluate_content(pair, tasks, {"translated": tr}, progress=progress), pair)
    console.print("content on held-out documentation (3 tasks per kind and length; "
                  "`kvlingo eval --task content` for the full benchmark):")  # fmt: skip
    for t in tables(result):
        console.print(t)
