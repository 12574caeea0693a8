"""The one resolver and the one loader: a translator spec and a direction -> a file; names -> a pair.

A translator *spec* is one of
    a path                        (an existing file: taken as it is)
    org/name[@revision][:file]    (a Hugging Face Hub id: downloaded, or read from the Hub cache)
    a demo file name              (with a demo pair: a file under weights/translators/)
    None                          (with a demo pair: its shipped default for the direction)
and a *direction*: forward (small -> large) or `reverse` (large -> small). The one rule about
absence lives here: a demo pair that ships no backward translator resolves to None (switching
back to the small model then re-reads), while a missing forward translator is an error.

`load_models_and_translators` loads the pair (named, or a demo pair when neither model is named)
and both translators, each validated against its direction of the pair. `mlx_kvlingo.load` and
every command load through it; nothing else in the package loads a pair for a command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_kvlingo.kv.translator import Translator

#: the demo pairs (`demo/pair.py`): the same small source, a dense or an MoE large target
DEMO_PAIRS = ("dense", "moe")


def resolve_translator_spec(
    spec: str | Path | None,
    reverse: bool = False,
    pair_name: str | None = None,
    demo_source: str | None = None,
) -> Path | None:
    """The translator file `spec` names for the direction (see the module docstring).

    `pair_name`: the demo pair the spec is read against ("dense", "moe"), or None for a named
    pair (then None resolves to None: no translator); `demo_source`: the demo small model
    whose defaults None means (`demo.pair.source_for`; None: the pair's default). Raises
    `FileNotFoundError` for a demo name that is not shipped, `HubError` (a ValueError) for
    what is neither a file nor a Hub id, `ValueError` for an unknown demo pair.
    """
    from mlx_kvlingo.models.hub import resolve_translator

    if pair_name is not None:
        from mlx_kvlingo.models.demo import pair as demo

        try:
            name = None if spec is None else str(spec)
            return demo.translator_path(name, reverse, pair_name, demo_source)
        except (FileNotFoundError, KeyError):
            if spec is None and reverse:
                return None  # no shipped backward translator: switching back re-reads
            raise
    if spec is None:
        return None
    return resolve_translator(spec, reverse)  # a path, or a Hub id (HubError: neither)


def _translator(
    spec: str | Path | Translator | None,
    pair: Any,
    reverse: bool,
    pair_name: str | None,
    demo_source: str | None = None,
) -> Translator | None:
    if isinstance(spec, Translator):
        return spec
    path = resolve_translator_spec(spec, reverse, pair_name, demo_source)
    if path is None:
        return None
    from mlx_kvlingo.models.files import load_translator

    return load_translator(path, pair)


def which_demo(source, target, demo_pair: str | None) -> str | None:
    """The demo pair to load, or None for the named pair: both models named (then no demo pair)
    or neither (then `demo_pair`, "dense" by default). A ValueError otherwise."""
    if source is None and target is None:
        demo_pair = demo_pair or "dense"
        if demo_pair not in DEMO_PAIRS:
            raise ValueError(f"unknown demo pair {demo_pair!r} (known: {', '.join(DEMO_PAIRS)})")
        return demo_pair
    if source is None or target is None:
        raise ValueError("give both source and target, or neither for the demo pair")
    if demo_pair is not None:
        raise ValueError("a demo pair is chosen by name only without source/target")
    return None


def load_models_and_translators(
    source: str | Path | None = None,
    target: str | Path | None = None,
    translator: str | Path | Translator | None = None,
    backward: str | Path | Translator | None = None,
    demo_pair: str | None = None,
    *,
    dtype: Any = "auto",
) -> tuple[Any, Translator | None, Translator | None]:
    """(pair, forward, backward): the pair and its small -> large and large -> small translators.

    Neither `source` nor `target`: the demo pair `demo_pair` (default "dense"), its shipped
    translators unless named. Both: that pair; a translator left None is None. `demo_pair` with
    a named model is a ValueError. Translators are checked against their direction of the pair
    (`TranslatorFileError`); a pair whose tokenizers differ raises `TokenizerMismatchError`.
    """
    from mlx_kvlingo.models.pair import load_pair

    small = None  # the demo source, for a demo pair
    demo_pair = which_demo(source, target, demo_pair)
    if demo_pair is not None:
        from mlx_kvlingo.models.demo import pair as demo

        # the small model is the demo source the named translator reads (default: the pair's)
        if translator is not None or backward is None:
            small = demo.source_for(translator, demo_pair)
        else:
            small = demo.source_for(backward, demo_pair, reverse=True)
        source, target = demo.demo_models(demo_pair, small)
    pair = load_pair(source, target, dtype=dtype)
    forward = _translator(translator, pair, False, demo_pair, small)
    back = _translator(backward, pair.reversed(), True, demo_pair, small)
    return pair, forward, back


def demo_paths(demo_pair: str | None, translator: Any = None) -> tuple[Path, Path]:
    """The demo pair's (source folder, target folder), built on first use; the source is the
    one `translator` reads (None: the pair's default)."""
    from mlx_kvlingo.models.demo import pair as demo

    demo_pair = demo_pair or "dense"
    return demo.demo_models(demo_pair, demo.source_for(translator, demo_pair))
