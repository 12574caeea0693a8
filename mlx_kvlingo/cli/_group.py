"""The `kvlingo` command group: `mlx_kvlingo.cli.<name>`'s `<name>_cmd`, imported when it runs
or shows its help; the model libraries only when it runs."""

from __future__ import annotations

import importlib

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.errors import DEBUG_ENV, user_errors

import click

COMMANDS = ("info", "translate", "generate", "chat", "calibrate", "eval", "bench", "convert",
            "upload", "download", "serve")  # fmt: skip


class KvlingoGroup(click.Group):
    """Runs every command inside `errors.user_errors`; resolves them lazily, by name."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        return getattr(importlib.import_module(f"mlx_kvlingo.cli.{name}"), f"{name}_cmd")

    def make_context(self, info_name, args, parent=None, **extra):
        with user_errors():  # the group's own options (`kvlingo --bogus`)
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with user_errors(ctx):
            return super().invoke(ctx)


@click.group(cls=KvlingoGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlx_kvlingo.__version__, prog_name="kvlingo")
@click.option("--debug", is_flag=True, envvar=DEBUG_ENV,
              help=f"Show the traceback of every error (also {DEBUG_ENV}=1)")  # fmt: skip
def cli(debug):
    """KV-cache translation between two language models on MLX."""
