"""`kvlingo`: a thin command line over the public Python API. One module per command.

`main` is the console script; the group (`cli`) loads on first use.
"""

from __future__ import annotations


def main() -> None:
    from mlx_kvlingo.cli._group import cli

    cli()


def __getattr__(name: str):
    if name == "cli":
        from mlx_kvlingo.cli._group import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
