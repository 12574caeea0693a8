"""`kvlingo upload FILE... org/name`: a Hub repo folder (translators, manifest, model card), pushed."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mlx_kvlingo.cli._params import OutputFolder

import click


@click.command("upload")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.argument("repo_id")
@click.option("--manifest", type=click.Path(exists=True, dir_okay=False),
              help="manifest.json to ship (default translators, quality); default: one listing FILES")  # fmt: skip
@click.option("--folder", type=OutputFolder(),
              help="Build the repo folder here (default: a temporary folder)")  # fmt: skip
@click.option("--no-push", is_flag=True, help="Only build the folder (with --folder)")
@click.option("--private", is_flag=True, help="Create the repo private")
@click.option("--license", "license_", help="License id for the model card (e.g. apache-2.0)")
@click.option("-m", "--message", help="Commit message")
def upload_cmd(files, repo_id, manifest, folder, no_push, private, license_, message):
    """Publish translator FILES to the Hub repo REPO_ID (org/name) with a generated card."""
    from mlx_kvlingo.models.hub import build_repo_folder, parse_spec, upload

    if parse_spec(repo_id) is None or "@" in repo_id or ":" in repo_id:
        raise click.BadParameter(f"{repo_id!r}: expected org/name", param_hint="REPO_ID")
    if no_push and not folder:
        raise click.UsageError("--no-push needs --folder (where to leave the repo folder)")
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(folder) if folder else Path(tmp)
        build_repo_folder(files, where, repo_id, manifest, license=license_)
        click.echo(f"repo folder: {where} ({', '.join(sorted(p.name for p in where.iterdir()))})")
        if no_push:
            return
        url = upload(where, repo_id, private=private, message=message)
    click.echo(f"pushed {repo_id}: {url}")
