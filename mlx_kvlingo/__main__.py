"""`kvlingo` (and `python -m mlx_kvlingo`): the command line, in a process whose heap asks for
transparent huge pages where that helps (`_hugepages.py`)."""

from __future__ import annotations


def main() -> None:
    from ._hugepages import reexecute_with_hugepages

    reexecute_with_hugepages()
    from .cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
