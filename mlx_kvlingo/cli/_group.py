"""The `kvlingo` command group: one module per command, each a thin layer over the public API."""

from __future__ import annotations

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.bench import bench_cmd
from mlx_kvlingo.cli.calibrate import calibrate_cmd
from mlx_kvlingo.cli.chat import chat_cmd
from mlx_kvlingo.cli.convert import convert_cmd
from mlx_kvlingo.cli.download import download_cmd
from mlx_kvlingo.cli.errors import DEBUG_ENV, user_errors
from mlx_kvlingo.cli.eval import eval_cmd
from mlx_kvlingo.cli.generate import generate_cmd
from mlx_kvlingo.cli.info import info_cmd
from mlx_kvlingo.cli.serve import serve_cmd
from mlx_kvlingo.cli.translate import translate_cmd
from mlx_kvlingo.cli.upload import upload_cmd

import click


class KvlingoGroup(click.Group):
    """The group that runs every command inside `errors.user_errors`: an error the user caused
    is one line (exit status 2 for usage, 1 for the rest), a programming error its traceback."""

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


COMMANDS = (info_cmd, translate_cmd, generate_cmd, chat_cmd, calibrate_cmd, eval_cmd, bench_cmd,
            convert_cmd, upload_cmd, download_cmd, serve_cmd)  # fmt: skip
for _command in COMMANDS:
    cli.add_command(_command)
