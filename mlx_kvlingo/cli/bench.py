"""`kvlingo bench`: switch TTFT (translation + first step) against re-prefill, on this machine;
several pairs side by side, a conversation under several policies, or a start against mlx-lm's."""

from __future__ import annotations

from mlx_kvlingo.cli._common import pair_option, source_option, target_option, translator_option
from mlx_kvlingo.cli._params import OutputFolder
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.models.loading import DEMO_PAIRS

import click

#: 4096-token prefills take minutes on a CPU: the default lengths depend on the backend
DEFAULT_LENGTHS = {"cpu": "64,256,1024", "gpu": "64,256,1024,4096"}


def default_lengths() -> str:
    import mlx.core as mx

    return DEFAULT_LENGTHS["gpu" if mx.default_device().type == mx.gpu else "cpu"]


def parse_lengths(_ctx, _param, value: str | None) -> list[int]:
    if value is None:
        value = default_lengths()
    try:
        lengths = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or lengths[0] < 2:
        raise click.BadParameter("lengths must be integers >= 2")
    return lengths


def _preset_names() -> list[str]:
    from mlx_kvlingo.eval.presets import PRESETS

    return list(PRESETS)


@click.command("bench")
@source_option
@target_option
@translator_option
@pair_option
@click.option("--preset", type=click.Choice(_preset_names()),
              help="A shape-faithful random pair (built once into the cache) instead of models")  # fmt: skip
@click.option("--lengths", default=None, callback=parse_lengths,
              help=f"Prefix lengths in tokens, comma-separated [default: {DEFAULT_LENGTHS['cpu']} on a "
              f"CPU, {DEFAULT_LENGTHS['gpu']} on a GPU]")  # fmt: skip
@click.option("-n", "--trials", default=3, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="Warm-up rounds (all lengths) before the measured ones")  # fmt: skip
@click.option("-o", "--out", default="bench-results", show_default=True, type=OutputFolder(),
              help="Folder for bench.md, bench.json, ttft.png")  # fmt: skip
@click.option("--max-minutes", type=click.FloatRange(0, min_open=True), default=None,
              help="Skip lengths whose extrapolated rounds would overrun this budget")  # fmt: skip
@click.option("--moe-loop/--no-moe-loop", default=False, show_default=True,
              help="CPU only: run MoE prefill as one GEMM per expert instead of gather_mm")  # fmt: skip
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
              default="auto", show_default=True,
              help="What the models and the translator compute in (auto: float32 on a CPU, as stored "
              "on a GPU); presets and --source/--target without --translator")  # fmt: skip
@click.option("--cache-dir", type=OutputFolder(), default=None,
              help="Where presets are built (default $KVLINGO_CACHE or ~/.cache/mlx-kvlingo)")  # fmt: skip
@click.option("--no-progress", is_flag=True, help="No progress bar")
@click.option("--side-by-side", "side_by_side", default=None,
              help="Comma-separated pairs benchmarked one after another in this run, summarized side by "
              "side: demo pairs (dense, moe) and presets; 'all' for both demo pairs and every preset "
              "but tiny")  # fmt: skip
@click.option("--conversation", is_flag=True,
              help="Time a multi-turn conversation: the large reads / the small reads / auto / cascade")  # fmt: skip
@click.option("--turns", default=8, show_default=True, type=click.IntRange(1),
              help="--conversation: turns")  # fmt: skip
@click.option("--user-lengths", default="32,128,512", callback=parse_lengths, show_default=True,
              help="--conversation: user-turn lengths in tokens, cycled")  # fmt: skip
@click.option("--answer-tokens", default=16, show_default=True, type=click.IntRange(1),
              help="--conversation: tokens per answer (end-of-sequence banned); without it: the small "
              "answer's length before an escalation in the cascade+ahead column")  # fmt: skip
@click.option("--escalation-rate", default=0.25, show_default=True, type=click.FloatRange(0, 1),
              help="--conversation: share of cascade turns escalated to the large model")  # fmt: skip
@click.option("--policies", default=None,
              help="--conversation: comma-separated policies to run (default: all) of: large reads, "
              "small reads, auto reads, cascade, cascade+ahead")  # fmt: skip
@click.option("--large-reads-last", default=ReaderPolicy().large_reads_last, show_default=True,
              type=click.IntRange(1),
              help="--conversation: where the small model reads, the large one still reads the turn's last "
              "this many tokens itself (as `kvlingo chat`); 1: the last token only")  # fmt: skip
@click.option("--recompute", "recompute_share", default=ReaderPolicy().recompute_share,
              show_default=True, type=click.FloatRange(0, 1),
              help="--conversation: and recomputes this share of the translated turn (as `kvlingo chat`)")  # fmt: skip
@click.option("--startup", is_flag=True,
              help="Time a start to the first token in fresh processes (-n of each, alternating): "
              "load with the rates reused, on a new cache folder, and mlx-lm's load of the same "
              "target")  # fmt: skip
def bench_cmd(source, target, translator, demo_pair, preset, lengths, trials, warmup, out, max_minutes,
              moe_loop, seed, dtype, cache_dir, no_progress, conversation, turns, user_lengths,
              answer_tokens, escalation_rate, policies, large_reads_last, recompute_share, side_by_side,
              startup):  # fmt: skip
    """Time to first token: the source prefills and the cache is translated (switch), or the
    target re-prefills. Writes a markdown table, JSON with every trial, and a TTFT plot."""
    from mlx_kvlingo._platform import moe_cpu
    from mlx_kvlingo.eval import bench, report

    import mlx.core as mx

    def log(msg):
        click.echo(msg, err=True)

    modes = [o for o, on in (("--startup", startup), ("--side-by-side", side_by_side),
                             ("--conversation", conversation)) if on]  # fmt: skip
    pairs = [o for o, on in (("--preset", preset), ("--side-by-side", side_by_side),
                             ("--source/--target/--translator", source or target or translator)) if on]  # fmt: skip
    if len(modes) > 1:
        raise click.UsageError(f"{' and '.join(modes)} are separate runs")
    if len(pairs) > 1:
        raise click.UsageError(f"name the pair once: {' or '.join(pairs)}")
    if startup and preset:
        raise click.UsageError("--startup times the demo pair or --source/--target, not a preset")
    dtype = dtype if dtype == "auto" else getattr(mx, dtype)
    settings = dict(trials=trials, warmup=warmup, seed=seed, progress=not no_progress, log=log,
                    answer_tokens=answer_tokens)  # fmt: skip
    if startup:
        from mlx_kvlingo.eval import startup as startup_bench

        result = startup_bench.run_startup_bench(source, target, translator, demo_pair,
                                                 trials=trials, log=log)  # fmt: skip
        return _show(startup_bench.write_outputs(result, out), log)
    if side_by_side:
        loaders = [(name, lambda name=name: _load(name, None, None, None, dtype, cache_dir, seed,
                                                  log)[:3])
                   for name in _side_by_side_names(side_by_side)]  # fmt: skip
        with moe_cpu.per_expert_loop(moe_loop):
            results = bench.run_side_by_side(loaders, lengths, **settings)
    elif conversation:
        from mlx_kvlingo.eval import conversation_bench as cb

        chosen = tuple(
            p.strip() for p in (policies or ",".join(cb.POLICIES)).split(",") if p.strip()
        )
        unknown = set(chosen) - set(cb.POLICIES)
        if unknown:
            raise click.UsageError(f"unknown --policies {sorted(unknown)}; "
                                   f"expected some of {', '.join(cb.POLICIES)}")  # fmt: skip
        cfg = cb.ConversationBenchConfig(turns=turns, user_lengths=tuple(user_lengths),
                                         answer_tokens=answer_tokens, escalation_rate=escalation_rate, seed=seed,
                                         policies=chosen, warmup=warmup > 0,
                                         policy=ReaderPolicy(large_reads_last=large_reads_last,
                                                             recompute_share=recompute_share))  # fmt: skip
        pair, tr, info, backward = _load(preset or demo_pair, source, target, translator, dtype,
                                         cache_dir, seed, log)  # fmt: skip
        with moe_cpu.per_expert_loop(moe_loop):
            results = cb.run_conversation_bench(pair, tr, backward, cfg, log=log, info=info)
        results["command"] = report.command_line()
        return _show(cb.write_outputs(results, out), log)
    else:
        pair, tr, info, _ = _load(preset or demo_pair, source, target, translator, dtype,
                                  cache_dir, seed, log)  # fmt: skip
        with moe_cpu.per_expert_loop(moe_loop) as patched:
            info["moe_per_expert_loop"] = patched
            max_seconds = None if max_minutes is None else 60 * max_minutes
            results = bench.run_bench(pair, tr, lengths, max_seconds=max_seconds, info=info,
                                      **settings)  # fmt: skip
    results["command"] = report.command_line()
    _show(bench.write_outputs(results, out), log)


def _show(paths: dict, log) -> None:
    click.echo(paths["markdown"].read_text())
    log("wrote " + ", ".join(str(p) for p in paths.values()))


def _side_by_side_names(names: str) -> list[str]:
    """The pairs `--side-by-side` names: demo pairs and presets; "all": both demo pairs and
    every preset but tiny."""
    from mlx_kvlingo.eval.presets import PRESETS

    if names.strip() == "all":
        return [*DEMO_PAIRS, *(p for p in PRESETS if p != "tiny")]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in DEMO_PAIRS and n not in PRESETS]
    if unknown:
        raise click.UsageError(f"unknown pair {unknown[0]!r} in --side-by-side; known: "
                               f"{', '.join([*DEMO_PAIRS, *PRESETS])}")  # fmt: skip
    return wanted


def _load(name, source, target, translator, dtype, cache_dir, seed, log):
    """(pair, translator, info, backward) for a preset or demo pair `name`, or the named
    models: a random translator of the pair's geometry where none is named (latency only);
    the backward translator is the demo pair's shipped one (None for the others)."""
    from mlx_kvlingo.cli._common import resolve_pair
    from mlx_kvlingo.eval.presets import PRESETS, get_preset, load_preset, random_translator

    if name in PRESETS and not (source or target):
        pair, tr, folder = load_preset(name, cache_dir, log=log, dtype=dtype)
        p = get_preset(name)
        return pair, tr, {"preset": {"name": p.name, "description": p.description,
                                     "folder": str(folder), "reference": p.reference}}, None  # fmt: skip
    if source and target and translator is None:  # latency only: any maps of the right shape
        pair, _, _ = resolve_pair(source, target, None, require_translator=False, dtype=dtype)
        tr = random_translator(pair, seed=seed)
        if dtype != "auto":
            tr.set_dtype(dtype)
        log("no --translator: timing a random translator of the pair's geometry (latency only)")
        return (
            pair,
            tr,
            {"translator_weights": "random (latency only: no --translator given)"},
            None,
        )
    if dtype != "auto":
        raise click.UsageError("--dtype applies to presets and --source/--target without "
                               "--translator")  # fmt: skip
    try:
        pair, tr, backward = resolve_pair(source, target, translator, demo_pair=name)
    except ImportError as e:
        raise click.ClickException(
            f"the demo pair is not available in this install ({e}); name a pair with "
            f"--source/--target/--translator or use --preset ({', '.join(PRESETS)})"
        ) from None
    demo = not (source or target)
    return pair, tr, {"demo_pair": name} if demo else {}, backward if demo else None
