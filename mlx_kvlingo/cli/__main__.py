"""`python -m mlx_kvlingo.cli`: the `kvlingo` command."""

from mlx_kvlingo.cli import main

main()
