"""Options and helpers shared by commands."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from mlx_kvlingo.cli._params import ModelSpec, TranslatorSpec
from mlx_kvlingo.config import AUTO_THRESHOLD, MODES, READERS, ReaderPolicy
from mlx_kvlingo.data.examples import DataConfig
from mlx_kvlingo.models.demo import DEMO_PAIRS

import click


def with_options(*opts):
    """A decorator: the click options `opts`, the first shown first."""
    return lambda f: functools.reduce(lambda g, opt: opt(g), reversed(opts), f)


def given(**values) -> dict:
    """The values given (not None)."""
    return {k: v for k, v in values.items() if v is not None}


def gathered(into: str, opts: list, make: Callable = given):
    """A decorator: the click options `opts`, passed to the command as one argument `into`:
    `make(**their values)`."""
    names = [p.name for p in with_options(*opts)(lambda: None).__click_params__]

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, **kw):
            kw[into] = make(**{k: kw.pop(k) for k in names})
            return f(*args, **kw)

        return with_options(*opts)(wrapper)

    return decorate


#: --small --large --translator --pair. The small model is the source of a forward translation, the
#: large one its target: `--source`/`--target` are their other names.
pair_options = with_options(
    click.option("--small", "--source", "source", type=ModelSpec(),
                 help="Small model (hub id or folder); default: demo pair"),
    click.option("--large", "--target", "target", type=ModelSpec(),
                 help="Large model (hub id or folder); default: demo pair"),
    click.option("--translator", type=TranslatorSpec(),
                 help="Translator file (.safetensors) or Hub id org/name[@revision][:file]"),
    # eager: read before --small/--large, which refuse to stand beside it
    click.option("--pair", "demo_pair", type=click.Choice(DEMO_PAIRS), default="dense",
                 is_eager=True, help="Demo pair (no --small/--large): the small model -> "
                                     "SmolLM2-135M-Instruct (dense) or -> its exact qwen2_moe upcycle (moe)"),
)  # fmt: skip


@contextmanager
def progress_bar(label: str, console) -> Iterator[Callable[..., None]]:
    """`progress(done, total, note="")` drawing one transient rich bar labelled `label`: the
    library reports progress through such callbacks and draws nothing."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(label), BarColumn(), TextColumn("{task.fields[count]}"),
               TextColumn("{task.fields[note]}"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None, count="", note="")
        yield lambda done, total, note="": bar.update(
            task, completed=done, total=total, count=f"{done:,}/{total:,}", note=note
        )


def demo_pair_of(source, target, demo_pair: str = "dense", translator=None, *,
                 require_translator: bool = False) -> str | None:  # fmt: skip
    """The pair options as typed: both --small and --large (None: that pair, with a
    --translator if `require_translator`), or neither (the demo pair --pair names; `ModelSpec`
    refuses --pair beside them)."""
    if bool(source) != bool(target):
        raise click.UsageError("give both --small and --large, or neither for the demo pair")
    if source and translator is None and require_translator:
        raise click.UsageError("--translator is required with --small/--large")
    return None if source else demo_pair


def resolve_pair(source, target, translator, demo_pair: str = "dense", *,
                 require_translator: bool = True, dtype="auto"):  # fmt: skip
    """(pair, forward, backward) through the one loader (`mlx_kvlingo.models.loading`): the named pair
    and translators, or a demo pair when no model is named (its shipped translators)."""
    from mlx_kvlingo.models.loading import load_models_and_translators

    demo = demo_pair_of(source, target, demo_pair, translator,
                        require_translator=require_translator)  # fmt: skip
    return load_models_and_translators(source, target, translator, None, demo, dtype=dtype)


def refuse_long_prompt(pair, n_tokens: int, hint: str) -> None:
    """A prompt longer than either model's context, refused before any work, naming `hint`."""
    for role, m in (("small", pair.source), ("large", pair.target)):
        limit = m.context_length
        if limit is not None and n_tokens > limit:
            raise click.BadParameter(f"the prompt has {n_tokens} tokens; the {role} ({m.name}) "
                                     f"handles at most {limit}: shorten it", param_hint=hint)  # fmt: skip


def content_texts(data_path) -> list[str]:
    """The content benchmark's text: `data_path`, or the demo's held-out documentation (never
    calibrated on)."""
    from mlx_kvlingo.data.examples import read_texts
    from mlx_kvlingo.models.demo.pair import demo_content_texts

    paths = demo_content_texts() if data_path is None else [data_path]
    return [t for p in paths for t in read_texts(p)]


def data_options(help: str, heldout_fraction=0.1, max_examples=True):
    """--data (`data_path`) and the example-drawing options, collected into one argument `data`:
    their `DataConfig`."""
    opts = [
        click.option("--min-prefix", type=click.IntRange(1), default=16),
        click.option("--max-prefix", type=click.IntRange(1), default=256),
        click.option("--continuation", type=click.IntRange(1), default=32),
        click.option("--heldout-fraction", type=click.FloatRange(0, 1), default=heldout_fraction,
                     help="Share of the documents held out (never trained on)"),
        click.option("--seed", type=click.IntRange(0), default=0),
    ]  # fmt: skip
    if max_examples:
        opts.insert(4, click.option("--max-examples", type=click.IntRange(1),
                                    help="Training examples to draw at most"))  # fmt: skip

    def config(**values) -> DataConfig:
        data = DataConfig(**values)
        if data.min_prefix > data.max_prefix:
            problem = f"{data.min_prefix} is above --max-prefix {data.max_prefix}"
            raise click.BadParameter(problem, param_hint="--min-prefix")
        return data

    data = click.option("--data", "data_path", type=click.Path(exists=True), help=help)
    return lambda f: data(gathered("data", opts, config)(f))


#: --temp --top-p --top-k --min-p --repetition-penalty --repetition-context-size --seed, collected
#: into one argument `sampling`: those given, as `stream_generate` keywords (those not given are
#: the answering model's defaults)
sampling_options = gathered("sampling", [
    click.option("--temp", type=click.FloatRange(0),
                 help="Temperature; 0 is greedy [default: the model's generation_config.json, else 0.7]"),
    click.option("--top-p", type=click.FloatRange(0, 1), help="[default: model's, else 0.9]"),
    click.option("--top-k", type=click.IntRange(0), help="[default: model's, else 0: off]"),
    click.option("--min-p", type=click.FloatRange(0, 1), help="[default: model's, else 0.05]"),
    click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True),
                 help="[default: model's, else 1.1; 1: off; with --temp 0 only if given]"),
    click.option("--repetition-context-size", type=click.IntRange(1),
                 help="Conversation tokens the penalty looks back over [default: 256]"),
    click.option("--seed", type=click.IntRange(0),
                 help="Seed MLX's generator (reproducible answers)"),
])  # fmt: skip

_D = ReaderPolicy()
#: how the large model reads a turn the small one read for it
READING = [
    click.option("--large-reads-last", type=click.IntRange(1),
                 help="When the small model reads a turn, the large one still reads its last "
                      f"this many tokens itself; 1: the last token [default: {_D.large_reads_last}]"),
    click.option("--recompute", "recompute_share", type=click.FloatRange(0, 1),
                 help="When the small model reads a turn, the large one also recomputes this "
                      "share of it (capped on long turns), the sentences its reading of the "
                      f"turn's end attended to most; 0: none [default: {_D.recompute_share:g}; "
                      "chat and serve: 0 with a pipelined large model]"),
]  # fmt: skip
#: --large-reads-last --recompute, collected into one argument `reading`: those given, as
#: `ReaderPolicy` keywords
reading_options = gathered("reading", READING)


def policy_for(recompute_share=None, **settings) -> Callable:
    """`policy(pair)`: the `ReaderPolicy` of the settings given for the loaded pair (no recompute
    unless given with a pipelined large model, which cannot)."""
    base = ReaderPolicy(**given(**settings, recompute_share=recompute_share))
    pipelined = replace(base, recompute_share=0.0) if recompute_share is None else base
    return lambda pair: pipelined if pair.link else base


def conversation_options(f):
    """--backward-translator --mode --auto-threshold, then the reader's options collected into one
    argument `policy` (`policy_for`)."""
    policy = gathered("policy", [
        click.option("--reader", type=click.Choice(READERS),
                     help="Who reads your turn before the large model answers [default: auto with "
                          "a forward translator]"),
        click.option("--reader-min-tokens", type=click.IntRange(0), default=_D.reader_min_tokens,
                     help="Reader tokens (and auto on a tie): later turns shorter than this are "
                          "read by the large model itself"),
        click.option("--min-retention", type=click.FloatRange(0, 1), default=_D.min_retention,
                     help="Reader auto: the small path only where this translator is measured to "
                          "keep at least this share of the content at the turn's length "
                          "(kvlingo eval --task content); 0: time alone"),
        *READING,
    ], policy_for)  # fmt: skip
    return with_options(
        click.option("--backward-translator", type=TranslatorSpec(),
                     help="Large -> small translator (default: the demo's, if any); without one, "
                          "switching back to small re-reads"),
        click.option("--mode", type=click.Choice(MODES), default="alternation",
                     help="How a model catches up on the turns it did not see"),
        click.option("--auto-threshold", default=AUTO_THRESHOLD,
                     help="auto (/auto): the large model answers again when the small answer's "
                          "mean token log-prob is below this"),
    )(policy(f))  # fmt: skip
