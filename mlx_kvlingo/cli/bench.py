"""`kvlingo bench`: time to first token on this machine (`mlx_kvlingo.eval`'s benchmarks)."""

from __future__ import annotations

import functools

from mlx_kvlingo.cli._common import gathered, pair_options, reading_options
from mlx_kvlingo.cli._params import KEPT_SHARES, ChoiceList, NumberList, OutputFolder
from mlx_kvlingo.config import POLICIES, ReaderPolicy
from mlx_kvlingo.eval.presets import PRESETS

import click

#: 4096-token prefills take minutes on a CPU: the default lengths depend on the backend
DEFAULT_LENGTHS = {"cpu": (64, 256, 1024), "gpu": (64, 256, 1024, 4096)}


def default_lengths() -> tuple[int, ...]:
    import mlx.core as mx

    return DEFAULT_LENGTHS["gpu" if mx.default_device().type == mx.gpu else "cpu"]


@click.command("bench", context_settings={"show_default": True})
@pair_options
@click.option("--preset", type=click.Choice(list(PRESETS)),
              help="A shape-faithful random pair (built once into the cache folder) instead of "
              "models")  # fmt: skip
@click.option("--lengths", type=NumberList(int, 2),
              help="Prefix lengths in tokens, comma-separated [default: 64,256,1024 on a CPU, "
              "64,256,1024,4096 on a GPU]")  # fmt: skip
@click.option("--specprefill", "keeps", default="0.2", type=KEPT_SHARES, metavar="SHARES",
              help="Also time speculative prefill, the peer that drops tokens, "
              "at these kept shares (comma-separated, e.g. 0.1,0.2,0.3; '' for none)")  # fmt: skip
@click.option("-n", "--trials", default=3, type=click.IntRange(1))
@click.option("--warmup", default=1, type=click.IntRange(0),
              help="Warm-up rounds (all lengths) before the measured ones")  # fmt: skip
@click.option("-o", "--out", default="bench-results", type=OutputFolder(),
              help="Folder for the tables (.md), the results (.json) and the plot")  # fmt: skip
@click.option("--max-minutes", type=click.FloatRange(0, min_open=True),
              help="Skip lengths whose extrapolated rounds would overrun this budget")  # fmt: skip
@click.option("--moe-loop/--no-moe-loop", default=False,
              help="CPU only: run MoE prefill as one GEMM per expert instead of gather_mm")  # fmt: skip
@click.option("--seed", type=click.IntRange(0), default=0)
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
              default="auto",
              help="What the models and the translator compute in (auto: float32 on a CPU, as "
              "stored on a GPU); presets and --source/--target without --translator")  # fmt: skip
@click.option("--no-progress", is_flag=True, help="No progress bar")
@click.option("--conversation", is_flag=True,
              help="Time a multi-turn conversation: the large reads / the small reads / auto / "
              "cascade")  # fmt: skip
@gathered("talk", [
    click.option("--turns", default=8, type=click.IntRange(1), help="--conversation: turns"),
    click.option("--user-lengths", default="32,128,512", type=NumberList(int, 2),
                 help="--conversation: user-turn lengths in tokens, cycled"),
    click.option("--answer-tokens", default=16, type=click.IntRange(1),
                 help="--conversation: tokens per answer (end-of-sequence banned)"),
    click.option("--escalation-rate", default=0.25, type=click.FloatRange(0, 1),
                 help="--conversation: share of cascade turns escalated to the large model"),
    click.option("--policies", type=ChoiceList(POLICIES), default=",".join(POLICIES),
                 show_default=False,
                 help="--conversation: comma-separated policies to run [default: all] of: large "
                 "reads, small reads, auto reads, cascade"),
])  # fmt: skip
@reading_options
@click.option("--startup", is_flag=True,
              help="Time a start to the first token in fresh processes (-n of each, alternating): "
              "load with the rates reused, on a new cache folder, and mlx-lm's load of the same "
              "target")  # fmt: skip
def bench_cmd(source, target, translator, demo_pair, preset, lengths, keeps, trials, warmup, out,
              max_minutes, moe_loop, seed, dtype, no_progress, conversation, talk, reading,
              startup):  # fmt: skip
    """Time to first token: the target re-prefills, the source prefills and the cache is
    translated (switch), or speculative prefill. Writes a markdown table, JSON with every trial,
    and a TTFT plot."""
    from contextlib import nullcontext

    from mlx_kvlingo._platform import moe_cpu
    from mlx_kvlingo.cli._common import progress_bar
    from mlx_kvlingo.eval import bench

    import mlx.core as mx
    from rich.console import Console

    log = functools.partial(click.echo, err=True)

    if startup and conversation:
        raise click.UsageError("--startup and --conversation are separate runs")
    if preset and (source or target or translator):
        raise click.UsageError("name the pair once: --preset or --source/--target/--translator")
    if startup and preset:
        raise click.UsageError("--startup times the demo pair or --source/--target, not a preset")
    if startup:
        from mlx_kvlingo.eval import startup as startup_bench

        result = startup_bench.run_startup_bench(source, target, translator, demo_pair,
                                                 trials=trials, log=log)  # fmt: skip
        return _show(startup_bench.write_outputs(result, out), log)
    dtype = dtype if dtype == "auto" else getattr(mx, dtype)
    pair, tr, info, back = _load(preset, demo_pair, source, target, translator, dtype, seed, log)
    if conversation:
        from mlx_kvlingo.eval import conversation_bench as cb

        cfg = cb.ConversationBenchConfig(**talk, seed=seed, warmup=warmup > 0,
                                         policy=ReaderPolicy(**reading))  # fmt: skip
        with moe_cpu.per_expert_loop(moe_loop):
            results = cb.run_conversation_bench(pair, tr, back, cfg, log=log, info=info)
        return _show(cb.write_outputs(results, out), log)
    bar = nullcontext() if no_progress else progress_bar("bench", Console(stderr=True))
    max_seconds = None if max_minutes is None else 60 * max_minutes
    with bar as progress, moe_cpu.per_expert_loop(moe_loop) as patched:
        info["moe_per_expert_loop"] = patched
        results = bench.run_bench(pair, tr, lengths or default_lengths(), trials=trials,
                                  warmup=warmup, seed=seed, keeps=keeps, max_seconds=max_seconds,
                                  progress=progress, log=log, info=info)  # fmt: skip
    _show(bench.write_outputs(results, out), log)


def _show(paths: dict, log) -> None:
    click.echo(paths["markdown"].read_text())
    log("wrote " + ", ".join(str(p) for p in paths.values()))


def _load(preset, demo_pair, source, target, translator, dtype, seed, log):
    """(pair, translator, info, backward) for a preset, the named models or a demo pair: a
    random translator of the pair's geometry where models but no translator are named (latency
    only); the backward translator is the demo pair's shipped one (None for the others)."""
    from mlx_kvlingo.cli._common import resolve_pair
    from mlx_kvlingo.eval.presets import load_preset, random_translator

    if preset:
        pair, tr, folder = load_preset(preset, log=log, dtype=dtype)
        p = PRESETS[preset]
        return pair, tr, {"preset": {"name": p.name, "description": p.description,
                                     "folder": str(folder), "reference": p.reference}}, None  # fmt: skip
    if source and target and translator is None:  # latency only: any maps of the right shape
        pair, _, _ = resolve_pair(source, target, None, require_translator=False, dtype=dtype)
        tr = random_translator(pair, seed=seed)
        if dtype != "auto":
            tr.set_dtype(dtype)
        log("no --translator: timing a random translator of the pair's geometry (latency only)")
        info = {"translator_weights": "random (latency only: no --translator given)"}
        return pair, tr, info, None
    if dtype != "auto":
        raise click.UsageError(
            "--dtype applies to presets and --source/--target without --translator"
        )
    pair, tr, backward = resolve_pair(source, target, translator, demo_pair=demo_pair)
    return (pair, tr, {}, None) if source else (pair, tr, {"demo_pair": demo_pair}, backward)
