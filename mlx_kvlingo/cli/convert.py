"""`kvlingo convert`: the converters package's command line (installed as `kvlingo_converters`)."""

from __future__ import annotations

import json

from mlx_kvlingo.cli._common import demo_pair_of
from mlx_kvlingo.cli._params import ModelSpec, OutputFile

import click


def converters_package():
    """A checkout's `converters`, else the installed `kvlingo_converters`."""
    import importlib

    for name in ("converters", "kvlingo_converters"):
        try:
            conv = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(conv, "LAYOUTS"):  # not another package of that name
            return conv
    raise click.ClickException(
        "the converters package is missing: install mlx-kvlingo from a checkout "
        "(pip install -e '.[torch]') or run `python -m converters` from the repository root"
    )


LAYOUT_NAMES = ["kv_lingo_translator_v1", "mapper_directory", "linear_state_dict",
                "v1", "mapper", "linear"]  # fmt: skip


@click.command("convert")
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=OutputFile(),
              help="Translator file to write (.safetensors)")  # fmt: skip
@click.option("--layout", type=click.Choice(LAYOUT_NAMES), help="Input layout (default: detect)")
@click.option("--source", type=ModelSpec(),
              help="Source model (hub id or folder): check geometry against it")  # fmt: skip
@click.option("--target", type=ModelSpec(),
              help="Target model (hub id or folder): check geometry against it")  # fmt: skip
@click.option("--source-layers", type=click.IntRange(1),
              help="mapper: the source's layer count, if not in the manifest")  # fmt: skip
@click.option("--source-geometry", metavar="L,H,D", help="linear: source layers,kv_heads,head_dim")
@click.option("--target-geometry", metavar="L,H,D", help="linear: target layers,kv_heads,head_dim")
@click.option("--sidecar", type=click.Path(exists=True, dir_okay=False),
              help="linear: JSON sidecar (default: INPUT.json or INPUT with .json)")  # fmt: skip
@click.option("--layer-map", help="linear: JSON source-layer lists per target layer, or 'identity'")
@click.option("--key-layers", help="linear: layer map for keys only (JSON)")
@click.option("--value-layers", help="linear: layer map for values only (JSON)")
@click.option("--key-cut", type=click.Choice(["post_norm", "pre_norm"]),
              help="where the keys were taken (after or before k_norm; always RoPE-free): "
                   "required for linear; for v1, overrides a cut string we do not recognise "
                   "(recorded in the provenance)")  # fmt: skip
def convert_cmd(input_path, output, layout, source, target, **options):
    """Convert a translator trained in PyTorch (INPUT: file or mapper directory)."""
    conv = converters_package()
    demo_pair_of(source, target)  # both or neither
    try:
        for side in ("source", "target"):  # the linear layout's geometries
            typed = options.pop(f"{side}_geometry")
            options[side] = conv.common.parse_geometry(typed, f"--{side}-geometry")
        for name in ("layer_map", "key_layers", "value_layers"):  # JSON rows, or 'identity'
            if options[name] not in (None, "identity"):
                try:
                    options[name] = json.loads(options[name])
                except json.JSONDecodeError as e:
                    problem = f"not JSON ({e}); e.g. '[[0,1],[2],[3]]' or 'identity'"
                    raise click.BadParameter(
                        problem, param_hint=f"--{name.replace('_', '-')}"
                    ) from None
        pair = None
        if source is not None:
            from mlx_kvlingo.models.loading import load_models_and_translators
            from mlx_kvlingo.models.pair import TokenizerMismatchError

            try:  # `python -m converters` runs this command outside the group's error mapping
                pair = load_models_and_translators(source, target)[0]
            except TokenizerMismatchError as e:
                raise click.ClickException(str(e)) from None
        path, done = conv.convert_file(input_path, output, layout, pair, **options)
    except conv.ConversionError as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from None
    c, p = done.config, done.provenance
    stated = " (stated with --key-cut)" if p.get("key_cut_override") else ""
    checked = "; geometry checked against the model pair" if pair is not None else ""
    click.echo(f"wrote {path}: {p['layout']} -> {c.variant}, key cut {c.key_cut}{stated}, "
               f"nu {c.nu_k}/{c.nu_v} (keys/values), bias {c.bias}\n"
               f"  source {c.source.layers}x{c.source.kv_heads}x{c.source.head_dim}, "
               f"target {c.target.layers}x{c.target.kv_heads}x{c.target.head_dim}; "
               f"input sha256 {p['input_sha256'][:16]}...{checked}")  # fmt: skip
