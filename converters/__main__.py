"""`python -m converters INPUT -o OUT ...`: the same command as `kvlingo convert`."""

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.convert import convert_cmd

if __name__ == "__main__":
    convert_cmd(prog_name="python -m converters")
