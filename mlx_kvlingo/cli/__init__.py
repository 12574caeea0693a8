"""`kvlingo`: a thin command line over the public Python API. One module per command."""

from mlx_kvlingo.cli._group import cli

main = cli  # the console script
