"""Options and helpers shared by commands."""

from __future__ import annotations

import click

from ..format import TranslatorFileError, load_translator
from ..hub import HubError, resolve_translator
from ..pair import TokenizerMismatchError, load_pair

source_option = click.option("--source", help="Source model (hub id or folder); default: demo pair")
target_option = click.option("--target", help="Target model (hub id or folder); default: demo pair")
translator_option = click.option(
    "--translator",
    help="Translator file (.safetensors) or Hub id org/name[@revision][:file]",
)


def resolve_pair(source, target, translator, reverse: bool = False):
    """Load the named pair and translator, or the embedded demo pair when none is named."""
    try:
        if source is None and target is None:
            from ..demo.pair import load_demo

            return load_demo(translator=translator, reverse=reverse)
        if not (source and target):
            raise click.UsageError("give both --source and --target, or neither for the demo pair")
        pair = load_pair(source, target)
        if translator is None:
            raise click.UsageError("--translator is required with --source/--target")
        return pair, load_translator(resolve_translator(translator, reverse), pair)
    except (TokenizerMismatchError, TranslatorFileError, HubError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
