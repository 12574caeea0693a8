"""The `kvlingo` command group: one module per command, each a thin layer over the public API."""

from __future__ import annotations

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)

import click

from .bench import bench_cmd
from .calibrate import calibrate_cmd
from .chat import chat_cmd
from .compare import compare_cmd
from .convert import convert_cmd
from .download import download_cmd
from .eval import eval_cmd
from .generate import generate_cmd
from .info import info_cmd
from .serve import serve_cmd
from .translate import translate_cmd
from .upload import upload_cmd


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
