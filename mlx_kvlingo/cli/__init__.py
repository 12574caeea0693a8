"""`kvlingo`: a thin command line over the public Python API. One module per command.

`main` is the console script: it first asks glibc for huge pages (`_hugepages`, which may
re-execute the process), then loads the commands; so the group (`cli`) loads on first use.
"""

from __future__ import annotations


def main() -> None:
    from mlx_kvlingo._platform.hugepages import reexecute_with_hugepages

    reexecute_with_hugepages()  # before the commands' imports (MLX, mlx-lm): seconds each time
    from mlx_kvlingo.cli._group import cli

    cli()


def __getattr__(name: str):
    if name == "cli":
        from mlx_kvlingo.cli._group import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
