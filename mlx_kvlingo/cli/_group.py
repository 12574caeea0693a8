"""The `kvlingo` command group: one module per command, each a thin layer over the public API."""

from __future__ import annotations

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.bench import bench_cmd
from mlx_kvlingo.cli.calibrate import calibrate_cmd
from mlx_kvlingo.cli.chat import chat_cmd
from mlx_kvlingo.cli.compare import compare_cmd
from mlx_kvlingo.cli.convert import convert_cmd
from mlx_kvlingo.cli.download import download_cmd
from mlx_kvlingo.cli.eval import eval_cmd
from mlx_kvlingo.cli.generate import generate_cmd
from mlx_kvlingo.cli.info import info_cmd
from mlx_kvlingo.cli.serve import serve_cmd
from mlx_kvlingo.cli.translate import translate_cmd
from mlx_kvlingo.cli.upload import upload_cmd

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlx_kvlingo.__version__, prog_name="kvlingo")
def cli():
    """KV-cache translation between two language models on MLX."""


cli.add_command(info_cmd)
cli.add_command(translate_cmd)
cli.add_command(generate_cmd)
cli.add_command(chat_cmd)
cli.add_command(calibrate_cmd)
cli.add_command(eval_cmd)
cli.add_command(compare_cmd)
cli.add_command(bench_cmd)
cli.add_command(convert_cmd)
cli.add_command(upload_cmd)
cli.add_command(download_cmd)
cli.add_command(serve_cmd)
