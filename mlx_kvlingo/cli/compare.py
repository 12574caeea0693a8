"""`kvlingo compare`: every cache hand-off method on one pair, same held-out data, one table."""

from __future__ import annotations

from mlx_kvlingo.calibrate import fit_kvlingo
from mlx_kvlingo.cli._common import (
    content_texts,
    data_config,
    data_options,
    demo_pair_of,
    pair_option,
    resolve_pair,
    source_option,
    target_option,
)
from mlx_kvlingo.cli._params import IntList, OutputFile
from mlx_kvlingo.data.examples import DataError, load_examples, validate_data
from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.compare import (
    FAMILIES,
    CompareConfig,
    calibrate_all,
    plot,
    run_compare,
    table,
)
from mlx_kvlingo.eval.methods import KVLingo, load_method
from mlx_kvlingo.models.files import TranslatorFileError
from mlx_kvlingo.models.loading import load_models_and_translators
from mlx_kvlingo.models.pair import TokenizerMismatchError

import click
from rich.console import Console


def _ints(value: str) -> tuple[int, ...]:
    """An `IntList` option's value (already checked) as integers."""
    return tuple(int(v) for v in value.split(",") if v.strip())


def _families(ctx, param, value: str) -> tuple[str, ...]:
    fams = tuple(m.strip() for m in value.split(",") if m.strip())
    bad = [m for m in fams if m not in FAMILIES]
    if bad or not fams:
        raise click.BadParameter(f"unknown methods {bad}; choose from {FAMILIES}", ctx, param)
    return fams


def _ranks(ctx, param, value: str) -> tuple[tuple[float, float], ...]:
    try:
        ranks = tuple(tuple(float(x) for x in r.split(":")) for r in value.split(",") if r.strip())
    except ValueError:
        ranks = ()
    if not ranks or any(len(r) != 2 or not all(0 < x <= 1 for x in r) for r in ranks):
        raise click.BadParameter(
            f"{value!r}: expected KEY:VALUE fractions in (0, 1], e.g. 0.25:0.5,1:1", ctx, param
        )
    return ranks


@click.command("compare")
@source_option
@target_option
@pair_option
@click.option(
    "--translator",
    "translators",
    multiple=True,
    type=click.Path(exists=True),
    help="A translator file to include (repeatable)",
)
@data_options(
    required=False,
    help="Text/JSONL data: calibration on the train split, scores on the held-out split; "
    "default: the demo's dialogues",
)
@click.option("--methods", default=",".join(FAMILIES), callback=_families, show_default=True,
              help="Method families to run")  # fmt: skip
@click.option("-n", "--examples", type=click.IntRange(1), default=32, show_default=True,
              help="Held-out examples scored")  # fmt: skip
@click.option("--calib-examples", type=click.IntRange(1), default=64, show_default=True,
              help="Training examples used")  # fmt: skip
@click.option(
    "--nu", type=IntList(1), default="1,2", show_default=True, help="KV-Lingo nu settings"
)
@click.option("--bits", type=IntList(1), default="4,8", show_default=True,
              help="Quantized-transfer bit widths")  # fmt: skip
@click.option("--droidspeak-layers", type=IntList(1), default="1,2,4", show_default=True,
              help="DroidSpeak recompute block sizes")  # fmt: skip
@click.option("--scd-ranks", default="0.125:0.25,0.25:0.5,1:1", callback=_ranks, show_default=True,
              help="SCD key:value ranks as fractions of the KV width")  # fmt: skip
@click.option("--ttft-tokens", type=click.IntRange(2), default=256, show_default=True,
              help="Prompt length for TTFT")  # fmt: skip
@click.option("--trials", type=click.IntRange(1), default=3, show_default=True,
              help="TTFT trials (median)")  # fmt: skip
@click.option(
    "--bandwidth",
    type=click.FloatRange(0, min_open=True),
    default=1.0,
    show_default=True,
    help="Link between producer and consumer, Gb/s, for TTFT + wire",
)
@click.option("--json", "json_out", type=OutputFile(), help="Write the results here")
@click.option("--plot", "plot_out", type=OutputFile(),
              help="Write the quality-latency Pareto plot (PNG) here")  # fmt: skip
@click.option("--content", "content_per_kind", type=click.IntRange(min=1), default=None,
              help="Also the content benchmark (`kvlingo eval --task content`) for every method: "
                   "this many tasks per kind and read length")  # fmt: skip
@click.option("--content-lengths", type=IntList(32), default="128,512", show_default=True,
              help="Read lengths of the content benchmark, in tokens")  # fmt: skip
def compare_cmd(source, target, demo_pair, translators, data_path, methods, examples, calib_examples,
                nu, bits, droidspeak_layers, scd_ranks, ttft_tokens, trials, bandwidth, json_out,
                plot_out, content_per_kind, content_lengths, **kw):  # fmt: skip
    """Compare KV-Lingo, raw, quantized, DroidSpeak and SCD cache hand-off on one pair.

    Each method is calibrated on the training split at several settings, scored on the same
    held-out examples and timed; methods that cannot serve the pair are listed with the reason.
    """
    console = Console()
    if not console.is_terminal:  # a file or a pipe: room for the whole table
        console = Console(width=180)
    log = lambda msg: console.print(f"[dim]{msg}[/dim]")  # noqa: E731
    demo = source is None and target is None
    if data_path is None and not demo:
        raise click.UsageError("--data is required with --source/--target")
    try:
        if data_path is not None:
            validate_data(data_path)  # before loading any model
        if demo:
            pair, demo_tr, _ = resolve_pair(None, None, None, demo_pair=demo_pair)
        else:
            demo_pair_of(source, target)
            pair, demo_tr, _ = load_models_and_translators(source, target)
        extra = [
            (f"kvlingo file {p}", load_method(p, pair, f"kvlingo file {p}")) for p in translators
        ]
        examples_path = data_path
        if data_path is None:  # dialogues the demo never trained on, split in two
            from mlx_kvlingo.models.demo.pair import demo_data

            examples_path, kw["heldout_fraction"] = demo_data()[1], 0.5
            log(f"demo data: {examples_path}, split in two by dialogue")
        train, held = load_examples(examples_path, pair.tokenizer, data_config(kw))
    except (DataError, TokenizerMismatchError, TranslatorFileError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if demo_tr is not None:
        extra.insert(0, ("kvlingo demo translator", KVLingo(demo_tr, "kvlingo demo translator")))
    if not held:
        raise click.ClickException("no held-out examples; raise --heldout-fraction")
    cfg = CompareConfig(
        methods=methods, kvlingo_nu=_ints(nu), quant_bits=_ints(bits),
        droidspeak_layers=_ints(droidspeak_layers), scd_ranks=scd_ranks,
        calib_examples=calib_examples, eval_examples=examples, ttft_tokens=ttft_tokens,
        ttft_trials=trials, bandwidth_gbps=bandwidth,
    )  # fmt: skip
    entries = None  # --content scores the same calibrated methods
    if content_per_kind:
        entries = calibrate_all(pair, train[:calib_examples], cfg, extra, True, log, fit_kvlingo)
    result = run_compare(pair, train, held, cfg, extra, entries, True, log, fit_kvlingo)
    console.print(table(result))
    if content_per_kind:
        result["content"] = _content(pair, entries, data_path, _ints(content_lengths),
                                     content_per_kind, kw["seed"], console, log)  # fmt: skip
    if json_out:
        report.write_json(result, json_out)
    if plot_out:
        plot(result, plot_out)
        log(f"wrote {plot_out}")


def _content(pair, entries, data_path, lengths, per_kind, seed, console, log) -> dict:
    """The content benchmark with every applicable method as a condition (same tasks)."""
    from mlx_kvlingo.eval.content import evaluate_content, fitting_tasks, tables, to_json

    try:
        tasks = fitting_tasks(pair, content_texts(data_path), lengths, per_kind, seed=seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    methods = {e.label: e.method for e in entries if e.method is not None}
    log(f"content benchmark: {len(tasks)} tasks x {len(methods) + 2} conditions")
    result = to_json(evaluate_content(pair, tasks, methods), pair)
    for t in tables(result):
        console.print(t)
    return result
