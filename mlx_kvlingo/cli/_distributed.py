"""`kvlingo generate` / `kvlingo chat` as ranks of an `mlx.launch` run (target pipelined).

Every rank runs the same command; rank 0 owns the terminal (reads the prompt or the chat
lines, prints the answer), the other ranks follow its requests and print nothing.
"""

from __future__ import annotations

import os
import sys

import click

from ..distributed import DistributedError, generate, load_sharded_pair, stop
from ..sampling import resolve as resolve_sampling

distributed_option = click.option(
    "--distributed/--single", default=None,
    help="Run as one rank of an mlx.launch run, the target pipelined over the ranks "
    "[default: when started by mlx.launch]",
)  # fmt: skip
wire_option = click.option(
    "--wire", type=click.Choice(["auto", "source", "target"]), default="auto", show_default=True,
    help="Distributed: send each rank the source K/V its layers read (it translates) or its "
    "translated target K/V; auto sends fewer bytes",
)  # fmt: skip


def wanted(flag) -> bool:
    from ..distributed import launched

    return launched() if flag is None else flag


def resolve_sharded(source, target, translator, wire):
    """The pair on this rank: named folders/ids, or the demo pair when none is named."""
    from ..hub import resolve_translator

    if source is None and target is None:
        from ..demo.pair import demo_models, translator_path

        source, target = demo_models()
        path = translator_path(translator)
    elif not (source and target and translator):
        raise click.UsageError("give --source, --target and --translator, or none (demo pair)")
    else:
        path = resolve_translator(translator, False)
    return load_sharded_pair(source, target, path, wire=wire)


def _fail(e: Exception) -> None:
    click.echo(f"Error: {e}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # MLX's ring may block on teardown once a peer is gone


def _seed(cfg) -> int:
    return cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(3), "little")


def run_generate(source, target, translator, wire, prompt, chat, max_tokens, sampling) -> None:
    try:
        sp = resolve_sharded(source, target, translator, wire)
        cfg = resolve_sampling(sp.target, **sampling)
        tokens = None
        if sp.rank == 0:
            tok = sp.tokenizer
            if chat and getattr(tok, "chat_template", None):
                msgs = [{"role": "user", "content": prompt}]
                tokens = tok.apply_chat_template(msgs, add_generation_prompt=True)
            else:
                tokens = tok.encode(prompt)
        last = None
        for r in generate(
            sp, tokens, max_tokens=max_tokens, seed=_seed(cfg), sampler=cfg.sampler(),
            logits_processors=cfg.logits_processors(),
        ):  # fmt: skip
            if sp.rank == 0:
                click.echo(r.text, nl=False)
            last = r
        if sp.rank == 0 and last is not None:
            click.echo()
            click.echo(
                f"{sp.size} ranks · target layers {_owners(sp)} · decode "
                f"{last.generation_tokens} tokens {last.generation_tps:.1f} tok/s",
                err=True,
            )
    except DistributedError as e:
        _fail(e)


def _owners(sp) -> str:
    return ", ".join(f"rank {r}: {o.start}-{o.stop - 1}" for r, o in enumerate(sp.owners))


def run_chat(source, target, translator, wire, max_tokens, sampling, system=None) -> None:
    """The large (pipelined) model answers every turn; the small one reads the conversation.

    Each turn hands the whole conversation over again (no incremental cache across turns).
    """
    try:
        sp = resolve_sharded(source, target, translator, wire)
        cfg = resolve_sampling(sp.target, **sampling)
        if sp.rank != 0:  # follow rank 0's requests until it says stop
            while True:
                got = False
                for _ in generate(sp, None, max_tokens=max_tokens, sampler=cfg.sampler(),
                                  logits_processors=cfg.logits_processors()):  # fmt: skip
                    got = True
                if not got and sp.stopped:
                    return
        messages = [{"role": "system", "content": system}] if system else []
        click.echo(f"[{sp.size} ranks · {_owners(sp)}] q: quit, r: reset", err=True)
        while True:
            try:
                line = input(">> ")
            except (EOFError, KeyboardInterrupt):
                line = "q"
            if line.strip() in ("q", "/quit"):
                stop(sp)
                return
            if line.strip() in ("r", "/reset"):
                messages = messages[:1] if system else []
                continue
            messages.append({"role": "user", "content": line})
            tokens = sp.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            pieces = []
            for r in generate(
                sp, tokens, max_tokens=max_tokens, seed=_seed(cfg), sampler=cfg.sampler(),
                logits_processors=cfg.logits_processors(),
            ):  # fmt: skip
                click.echo(r.text, nl=False)
                pieces.append(r.text)
            click.echo()
            messages.append({"role": "assistant", "content": "".join(pieces)})
    except DistributedError as e:
        _fail(e)
