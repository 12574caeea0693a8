"""`kvlingo eval`: native / translated / raw / source-alone quality on held-out data."""

from __future__ import annotations

import json

import click
from rich.console import Console

from ..data import DataError, load_examples, validate_data
from ..measure.evaluate import evaluate, table
from ._common import (
    data_config,
    data_options,
    pair_option,
    resolve_pair,
    source_option,
    target_option,
    translator_option,
)


@click.command("eval")
@source_option
@target_option
@translator_option
@pair_option
@data_options(
    required=False,
    help="Text files, JSONL records ({'messages': [...]} or {'text': ...}) or a folder; every "
    "document is scored unless --heldout-fraction picks a share (drawn as calibrate draws its "
    "held-out split, with the same --seed); default: the demo's held-out dialogues",
    heldout_fraction=1.0,
    max_examples=False,
)
@click.option("-n", "--examples", default=64, show_default=True, help="Examples to score at most")
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False), help="Also write the results here"
)
@click.option("--multi-turn", is_flag=True, help="Multi-turn alternation evaluation over dialogues")
@click.option(
    "--switches", default=10, show_default=True, help="Switches per dialogue (--multi-turn)"
)
@click.option(
    "--reader",
    "reader_eval",
    is_flag=True,
    help="With --multi-turn: the large answers every turn while the small reads (vs re-prefill)",
)
def eval_cmd(source, target, translator, demo_pair, data_path, examples, json_out, multi_turn, switches,
             reader_eval, **kw):  # fmt: skip
    """Score the target on held-out continuations under every cache condition."""
    console = Console()
    if data_path is not None and not multi_turn:
        try:
            summary = validate_data(data_path)  # before loading any model
        except DataError as e:
            raise click.ClickException(str(e)) from None
        console.print(
            f"[grey50]{data_path}: {summary['files']} file(s), {summary['chats']} chats, "
            f"{summary['texts']} texts[/grey50]"
        )
    pair, tr = resolve_pair(source, target, translator, demo_pair=demo_pair)
    if reader_eval and not multi_turn:
        raise click.UsageError("--reader goes with --multi-turn")
    if multi_turn:
        return _multi_turn(pair, tr, source, target, examples, switches, json_out, console,
                           reader_eval, demo_pair)  # fmt: skip
    if data_path is None:  # the demo's held-out dialogues, never trained on
        from ..demo.pair import demo_eval_data

        data_path = demo_eval_data()
        kw["heldout_fraction"] = 1.0
    try:
        _, held = load_examples(
            data_path, pair.tokenizer, data_config({"data_path": data_path, **kw})
        )
    except DataError as e:
        raise click.ClickException(str(e)) from None
    if not held:
        raise click.ClickException(f"{data_path}: no examples to score; raise --heldout-fraction")
    result = evaluate(pair, tr, held[:examples])
    result["translator"] = translator or "demo"
    result["data"] = str(data_path)
    console.print(table(result, f"{pair.source.name} -> {pair.target.name}"))
    console.print(
        f"scored {result['examples']} examples, {result['tokens']} continuation tokens "
        f"(of {len(held)} drawn from {data_path})"
    )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)


def _multi_turn(pair, tr, source, target, dialogues, switches, json_out, console, reader=False,
                demo_pair="dense"):  # fmt: skip
    from ..measure.multiturn import (
        evaluate_multiturn,
        evaluate_reader,
        load_chitchat,
        render_reader_table,
        render_table,
    )

    backward = None
    if source is None and target is None:
        from ..demo.pair import load_demo

        _, backward = load_demo(reverse=True, pair=demo_pair)
    if reader:  # `switches` counts the large model's turns here
        result = evaluate_reader(pair, tr, backward, load_chitchat(dialogues), turns=switches)
        render_reader_table(result, console)
    else:
        result = evaluate_multiturn(pair, tr, backward, load_chitchat(dialogues), switches=switches)
        render_table(result, console)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
