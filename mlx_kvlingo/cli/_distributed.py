"""`kvlingo generate` / `chat` as ranks of an `mlx.launch` run (target pipelined): rank 0 runs
the command; on the other ranks `load` serves rank 0 and ends the process when it is done."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mlx_kvlingo.cli._common import demo_pair_of, with_options

import click

#: --distributed/--single --wire
options = with_options(
    click.option("--distributed/--single", default=None,
                 help="Run as one rank of an mlx.launch run, the target pipelined over the "
                 "ranks [default: when started by mlx.launch]"),
    click.option("--wire", type=click.Choice(["auto", "source", "target"]), default="auto",
                 help="Distributed: send each rank the source K/V its layers read (it "
                 "translates) or its translated target K/V; auto sends fewer bytes"),
)  # fmt: skip


def wanted(flag) -> bool:
    from mlx_kvlingo.distributed.pipeline import launched

    return launched() if flag is None else flag


def pair_from_options(source, target, translator, backward, demo_pair, distributed, wire):
    """The pair the options name, through `mlx_kvlingo.load` (no warm-up): under `mlx.launch`
    (or `--distributed`) the large model pipelined, ranks > 0 serving inside this call."""
    from mlx_kvlingo.api import load

    demo = demo_pair_of(source, target, demo_pair, translator, require_translator=True)
    with rank_errors():
        return load(source, target, translator, backward, pair=demo,
                    distributed=wanted(distributed), wire=wire, warmup=False)  # fmt: skip


def describe(pair) -> str:
    owners = ", ".join(f"rank {r}: {o.start}-{o.stop - 1}" for r, o in enumerate(pair.link.owners))
    return f"large model pipelined over {pair.link.ranks} ranks (layers {owners})"


@contextmanager
def rank_errors() -> Iterator[None]:
    """A lost or unreachable rank ends the run with one line (`fail`)."""
    from mlx_kvlingo.distributed.pipeline import DistributedError

    try:
        yield
    except DistributedError as e:
        click.echo(f"Error: {e}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # MLX's ring may block on teardown once a peer is gone
