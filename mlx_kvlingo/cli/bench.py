"""`kvlingo bench`: switch TTFT (translation + first step) against re-prefill, on this machine."""

from __future__ import annotations

from mlx_kvlingo.cli._common import pair_option, source_option, target_option, translator_option
from mlx_kvlingo.cli._params import IntList, OutputFolder
from mlx_kvlingo.config import ReaderPolicy

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
        raise click.BadParameter("prefix lengths must be integers >= 2")
    return lengths


def _preset_names() -> list[str]:
    from mlx_kvlingo.eval.presets import PRESETS

    return list(PRESETS)


@click.command("bench")
@source_option
@target_option
@translator_option
@pair_option
@click.option(
    "--preset",
    type=click.Choice(_preset_names()),
    help="A shape-faithful random pair (built once into the cache) instead of models",
)
@click.option(
    "--lengths",
    default=None,
    callback=parse_lengths,
    help=f"Prefix lengths in tokens, comma-separated [default: {DEFAULT_LENGTHS['cpu']} on a "
    f"CPU, {DEFAULT_LENGTHS['gpu']} on a GPU]",
)
@click.option("-n", "--trials", default=3, show_default=True, type=click.IntRange(1))
@click.option(
    "--warmup",
    default=1,
    show_default=True,
    type=click.IntRange(0),
    help="Warm-up rounds (all lengths) before the measured ones",
)
@click.option(
    "-o",
    "--out",
    default="bench-results",
    show_default=True,
    type=OutputFolder(),
    help="Folder for bench.md, bench.json, ttft.png",
)
@click.option(
    "--max-minutes",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Skip lengths whose extrapolated rounds would overrun this budget",
)
@click.option(
    "--moe-loop/--no-moe-loop",
    default=False,
    show_default=True,
    help="CPU only: run MoE prefill as one GEMM per expert instead of gather_mm",
)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
    default="auto",
    show_default=True,
    help="What the models and the translator compute in (auto: float32 on a CPU, as stored "
    "on a GPU)",
)
@click.option(
    "--cache-dir",
    type=OutputFolder(),
    default=None,
    help="Where presets are built (default $KVLINGO_CACHE or ~/.cache/mlx-kvlingo)",
)
@click.option("--no-progress", is_flag=True, help="No progress bar")
@click.option(
    "--side-by-side",
    "side_by_side",
    default=None,
    help="Comma-separated pairs benchmarked one after another in this run, summarized side by "
    "side: demo pairs (dense, moe) and presets; 'all' for both demo pairs and every preset "
    "but tiny",
)
@click.option(
    "--conversation",
    is_flag=True,
    help="Time a multi-turn conversation: the large reads / the small reads / auto / cascade",
)
@click.option(
    "--turns", default=8, show_default=True, type=click.IntRange(1), help="--conversation: turns"
)
@click.option(
    "--user-lengths",
    type=IntList(2),
    default="32,128,512",
    show_default=True,
    help="--conversation: user-turn lengths in tokens, cycled",
)
@click.option(
    "--answer-tokens",
    default=16,
    show_default=True,
    type=click.IntRange(1),
    help="--conversation: tokens per answer (end-of-sequence banned); without it: the small "
    "answer's length before an escalation in the cascade+ahead column",
)
@click.option(
    "--escalation-rate",
    default=0.25,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="--conversation: share of cascade turns escalated to the large model",
)
@click.option(
    "--policies",
    default=None,
    help="--conversation: comma-separated policies to run (default: all but 'tokens reads'); "
    "of: large reads, small reads, auto reads, tokens reads, cascade, cascade+ahead, "
    "cascade+ahead (no budget)",
)
@click.option(
    "--large-reads-last",
    default=ReaderPolicy().large_reads_last,
    show_default=True,
    type=click.IntRange(1),
    help="--conversation: where the small model reads, the large one still reads the turn's last "
    "this many tokens itself (as `kvlingo chat`); 1: the last token only",
)
@click.option(
    "--recompute",
    "recompute_share",
    default=ReaderPolicy().recompute_share,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="--conversation: and recomputes this share of the translated turn (as `kvlingo chat`)",
)
@click.option(
    "--startup",
    is_flag=True,
    help="Time a start to the first token in fresh processes (-n of each, alternating): "
    "Runtime.load with the rates reused, on a new cache folder, and mlx-lm's load of the same "
    "target",
)
def bench_cmd(source, target, translator, demo_pair, preset, lengths, trials, warmup, out, max_minutes,
              moe_loop, seed, dtype, cache_dir, no_progress, conversation, turns, user_lengths,
              answer_tokens, escalation_rate, policies, large_reads_last, recompute_share, side_by_side,
              startup):  # fmt: skip
    """Time to first token: the source prefills and the cache is translated (switch), or the
    target re-prefills. Writes a markdown table, JSON with every trial, and a TTFT plot."""
    from mlx_kvlingo._platform import moe_cpu
    from mlx_kvlingo.eval import bench, report

    def log(msg):
        click.echo(msg, err=True)

    import mlx.core as mx

    dtype = dtype if dtype == "auto" else getattr(mx, dtype)
    if startup:
        if preset or side_by_side or conversation:
            raise click.UsageError("--startup times the demo pair or --source/--target: not "
                                   "with --preset, --side-by-side or --conversation")  # fmt: skip
        from mlx_kvlingo.eval import startup as startup_bench

        result = startup_bench.run_startup_bench(source, target, translator, demo_pair,
                                                 trials=trials, log=log)  # fmt: skip
        paths = startup_bench.write_outputs(result, out)
        click.echo(paths["markdown"].read_text())
        log("wrote " + ", ".join(str(p) for p in paths.values()))
        return
    if side_by_side:
        if preset or source or target or translator or conversation:
            raise click.UsageError("--side-by-side names its pairs: not with --preset, "
                                   "--source/--target or --conversation")  # fmt: skip
        _side_by_side(side_by_side, lengths, trials, warmup, out, seed, dtype, cache_dir,
                      no_progress, moe_loop, answer_tokens, log)  # fmt: skip
        return
    info = {}
    if preset:
        if source or target or translator:
            raise click.UsageError("give --preset or --source/--target/--translator, not both")
        from mlx_kvlingo.eval.presets import get_preset, load_preset

        pair, tr, folder = load_preset(preset, cache_dir, log=log, dtype=dtype)
        p = get_preset(preset)
        info["preset"] = {"name": p.name, "description": p.description, "folder": str(folder),
                          "reference": p.reference}  # fmt: skip
    elif source and target and translator is None:  # latency only: any maps of the right shape
        from mlx_kvlingo.cli._common import resolve_pair
        from mlx_kvlingo.eval.presets import random_translator

        pair, _, _ = resolve_pair(source, target, None, require_translator=False, dtype=dtype)
        tr = random_translator(pair, seed=seed)
        if dtype != "auto":
            tr.set_dtype(dtype)
        info["translator_weights"] = "random (latency only: no --translator given)"
        log("no --translator: timing a random translator of the pair's geometry (latency only)")
    else:
        from mlx_kvlingo.cli._common import resolve_pair

        if dtype != "auto":
            raise click.UsageError("--dtype applies to --preset or --source/--target pairs")

        try:
            pair, tr, demo_backward = resolve_pair(source, target, translator, demo_pair=demo_pair)
        except ImportError as e:
            raise click.ClickException(
                f"the demo pair is not available in this install ({e}); name a pair with "
                "--source/--target/--translator or use --preset "
                f"({', '.join(_preset_names())})"
            ) from None
    if conversation:
        from mlx_kvlingo.eval import conversation_bench as cb

        backward = None
        if not (preset or source or target):  # the demo pair's shipped backward translator
            backward = demo_backward
        cfg = cb.ConversationBenchConfig(turns=turns, user_lengths=tuple(parse_lengths(None, None, user_lengths)),
                                         answer_tokens=answer_tokens, escalation_rate=escalation_rate, seed=seed,
                                         warmup=warmup > 0,
                                         policy=ReaderPolicy(large_reads_last=large_reads_last,
                                                             recompute_share=recompute_share))  # fmt: skip
        if policies:
            cfg.policies = tuple(p.strip() for p in policies.split(",") if p.strip())
            unknown = set(cfg.policies) - set(cb.ALL_POLICIES)
            if unknown:
                raise click.UsageError(f"unknown --policies {sorted(unknown)}; "
                                       f"expected some of {', '.join(cb.ALL_POLICIES)}")  # fmt: skip
        with moe_cpu.per_expert_loop(moe_loop):
            result = cb.run_conversation_bench(pair, tr, backward, cfg, log=log, info=info)
        result["command"] = report.command_line()
        paths = cb.write_outputs(result, out)
        click.echo(paths["markdown"].read_text())
        return
    with moe_cpu.per_expert_loop(moe_loop) as patched:
        info["moe_per_expert_loop"] = patched
        results = bench.run_bench(
            pair, tr, lengths, trials=trials, warmup=warmup, seed=seed,
            max_seconds=None if max_minutes is None else 60 * max_minutes,
            progress=not no_progress, log=log, info=info, answer_tokens=answer_tokens,
        )  # fmt: skip
    results["command"] = report.command_line()
    paths = bench.write_outputs(results, out)
    click.echo(paths["markdown"].read_text())
    log("wrote " + ", ".join(str(p) for p in paths.values()))


def _side_by_side(names, lengths, trials, warmup, out, seed, dtype, cache_dir, no_progress,
                  moe_loop, answer_tokens, log):  # fmt: skip
    from mlx_kvlingo._platform import moe_cpu
    from mlx_kvlingo.cli._common import resolve_pair
    from mlx_kvlingo.eval import bench_pairs, report
    from mlx_kvlingo.eval.presets import PRESETS, get_preset, load_preset

    demos = ("dense", "moe")
    if names.strip() == "all":
        wanted = [*demos, *(p for p in PRESETS if p != "tiny")]
    else:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in demos and n not in PRESETS]
    if unknown:
        raise click.UsageError(f"unknown pair {unknown[0]!r} in --side-by-side; known: "
                               f"{', '.join([*demos, *PRESETS])}")  # fmt: skip

    def loader(name):
        def load():
            if name in demos:
                if dtype != "auto":
                    raise click.UsageError("--dtype applies to presets, not the demo pairs")
                pair, tr, _ = resolve_pair(None, None, None, demo_pair=name)
                return pair, tr, {"demo_pair": name}
            pair, tr, folder = load_preset(name, cache_dir, log=log, dtype=dtype)
            p = get_preset(name)
            return pair, tr, {"preset": {"name": p.name, "description": p.description,
                                         "folder": str(folder), "reference": p.reference}}  # fmt: skip

        return load

    with moe_cpu.per_expert_loop(moe_loop):
        results = bench_pairs.run_side_by_side(
            [(n, loader(n)) for n in wanted], lengths, log=log, trials=trials, warmup=warmup,
            seed=seed, progress=not no_progress, answer_tokens=answer_tokens,
        )  # fmt: skip
    results["command"] = report.command_line()
    paths = bench_pairs.write_outputs(results, out)
    click.echo(paths["markdown"].read_text())
    log("wrote " + ", ".join(str(p) for p in paths.values()))
