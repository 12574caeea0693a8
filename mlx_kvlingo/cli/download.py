"""`kvlingo download org/name[@revision][:file]`: translators into the Hub cache (or a folder)."""

from __future__ import annotations

from mlx_kvlingo.cli._params import OutputFolder

import click


@click.command("download")
@click.argument("spec", metavar="ORG/NAME[@REVISION][:FILE]")
@click.option("--local-dir", type=OutputFolder(),
              help="Copy into this folder instead of only the Hub cache")  # fmt: skip
def download_cmd(spec, local_dir):
    """Fetch a translator repo (or one file) from the Hub, for later or offline use."""
    from mlx_kvlingo.models.hub import download

    path = download(spec, local_dir)
    if path.is_dir():  # with subfolders: source15/forward.safetensors
        files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    else:
        files = [path.name]
    click.echo(f"{path}\n  " + "\n  ".join(files))
