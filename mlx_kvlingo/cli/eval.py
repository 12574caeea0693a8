"""`kvlingo eval`: quality on held-out data, or (`--task content`) of what the target can use."""

from __future__ import annotations

from dataclasses import replace

from mlx_kvlingo.cli._common import (
    content_texts,
    data_options,
    pair_options,
    progress_bar,
    reading_options,
    resolve_pair,
)
from mlx_kvlingo.cli._params import KEPT_SHARES, ChoiceList, NumberList, OutputFile
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.data.content_tasks import DEFAULT_KINDS, KINDS
from mlx_kvlingo.data.examples import load_examples, validate_data

import click
from rich.console import Console


@click.command("eval", context_settings={"show_default": True})
@pair_options
@data_options(
    help="Text files, JSONL records ({'messages': [...]} or {'text': ...}) or a folder; every "
    "document is scored unless --heldout-fraction picks a share (drawn as calibrate draws its "
    "held-out split, with the same --seed); default: the demo's held-out dialogues",
    heldout_fraction=1.0,
    max_examples=False,
)
@click.option("-n", "--examples", type=click.IntRange(1), default=64,
              help="Examples to score at most")  # fmt: skip
@click.option("--json", "json_out", type=OutputFile(), help="Also write the results here")
@click.option("--task", type=click.Choice(["continuation", "content"]), default="continuation",
              help="continuation: teacher-forced scores on held-out text; content: can the target use what "
              "was read (stated facts, copies, answers and summaries, scored against its native answer)")  # fmt: skip
@click.option("--lengths", type=NumberList(int, 32), default="128,512,1024",
              help="--task content: read lengths in tokens, up to the pair's context")  # fmt: skip
@click.option("--per-kind", type=click.IntRange(1), default=8,
              help="--task content: tasks of each kind at each length")  # fmt: skip
@click.option("--kinds", default=",".join(DEFAULT_KINDS), type=ChoiceList(KINDS),
              help="--task content: the task kinds, comma-separated (also: facts, three facts with one asked)")  # fmt: skip
@click.option("--plot", "plot_out", type=OutputFile(),
              help="--task content: write the per-length plot here (PNG)")  # fmt: skip
@reading_options
@click.option("--specprefill", "keeps", default=(), type=KEPT_SHARES, metavar="SHARES",
              help="--task content: also run the peer that drops tokens, speculative prefill "
                   "(the small model's look-ahead picks 32-token chunks, the large model reads "
                   "only those), at these kept shares, e.g. 0.1,0.2,0.3")  # fmt: skip
def eval_cmd(source, target, translator, demo_pair, data_path, examples, json_out, task, lengths,
             per_kind, kinds, plot_out, reading, keeps, data):  # fmt: skip
    """Score the target on held-out continuations under every cache condition, or (--task
    content) on what it can use of what was read."""
    from mlx_kvlingo.eval import report
    from mlx_kvlingo.eval.evaluate import evaluate, table

    console = Console()
    if task == "content":
        from mlx_kvlingo.eval import content as c

        texts = content_texts(data_path)  # before loading any model
        pair, tr, _ = resolve_pair(source, target, translator, demo_pair=demo_pair)
        seed = data.seed
        tasks = c.fitting_tasks(pair, texts, lengths, per_kind, seed=seed, kinds=kinds)
        console.print(f"[grey50]{len(tasks)} content tasks ({per_kind} per kind and length, seed "
                      f"{seed}); the target answers natively first, then from the translated "
                      f"cache; greedy[/grey50]")  # fmt: skip
        # both through the chat's own hand-off: the whole turn translated (the large model reads
        # the last token only), and the chat's reading (its last tokens, then the recompute)
        p = ReaderPolicy(**reading)
        conditions = {"translated": c.Chat(tr, 1, 0.0),
                      "chat": c.Chat(tr, p.large_reads_last, p.recompute_share),
                      **{f"specprefill {k:g}": c.Peer(k, seed) for k in keeps}}  # fmt: skip
        label = {"translator": translator or "demo default", "seed": seed, "lengths": list(lengths)}
        with progress_bar("content", console) as progress:
            result = c.evaluate_content(pair, tasks, conditions, progress=progress)
        result = c.to_json(result, pair, label)
        for t in c.tables(result):
            console.print(t)
        if json_out:
            report.write_json(result, json_out)
        if plot_out:
            c.plot(result, plot_out)
        draw = f"data {data_path or 'demo'}, seed {seed}, kinds {','.join(kinds)}"
        return _store_retention(pair, tr, p, c.retention(result), draw, console)
    if reading or plot_out or keeps:
        raise click.UsageError("--large-reads-last, --recompute, --plot and --specprefill go "
                               "with --task content")  # fmt: skip
    if data_path is not None:
        summary = validate_data(data_path)  # before loading any model
        console.print(
            f"[grey50]{data_path}: {summary['files']} file(s), {summary['chats']} chats, "
            f"{summary['texts']} texts[/grey50]"
        )
    pair, tr, _ = resolve_pair(source, target, translator, demo_pair=demo_pair)
    if data_path is None:  # the demo's held-out dialogues, never trained on
        from mlx_kvlingo.models.demo.pair import demo_data

        data_path, data = demo_data()[1], replace(data, heldout_fraction=1.0)
    _, held = load_examples(data_path, pair.tokenizer, data)
    if not held:
        raise click.ClickException(f"{data_path}: no examples to score; raise --heldout-fraction")
    with progress_bar("evaluating", console) as progress:
        result = evaluate(pair, tr, held[:examples], progress)
    result |= {"translator": translator or "demo", "data": str(data_path)}
    console.print(table(result, f"{pair.source.name} -> {pair.target.name}"))
    console.print(
        f"scored {result['examples']} examples, {result['tokens']} continuation tokens "
        f"(of {len(held)} drawn from {data_path})"
    )
    if json_out:
        report.write_json(result, json_out)


def _store_retention(pair, tr, policy, counts, draw, console) -> None:
    """Add the chat condition's retention counts to those in the cache folder, where reader
    "auto" of this pair, translator and settings finds them (conversation/reader.py)."""
    from mlx_kvlingo.conversation import reader as kept

    if not counts:
        return
    try:
        draws = kept.record_retention(kept.retention_key(pair, tr, policy), draw, counts)
    except OSError as e:
        console.print(f"[yellow]retention not stored: {e}[/yellow]")
        return
    shown = ", ".join(f"{n} tok {k}/{r}" + ("" if r >= kept.MIN_RIGHT else " (too few yet)")
                      for n, k, r in kept.pooled(*draws.values()))  # fmt: skip
    pooled = f", pooled over {len(draws)} draws" if len(draws) > 1 else ""
    console.print(f"[grey50]retention stored for reader auto, facts and copies kept / native "
                  f"right{pooled}: {shown} (a length counts once the native read got "
                  f"{kept.MIN_RIGHT} right there)[/grey50]")  # fmt: skip
