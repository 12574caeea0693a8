"""The one loader: model names -> a pair; a translator spec and a direction -> a file.

A translator spec is a path, a Hub id `org/name[@revision][:file]`, a demo file name (with a
demo pair, under weights/translators/) or None (with a demo pair: its shipped default). A demo
pair that ships no backward translator resolves to None (switching back re-reads); a missing
forward translator is an error. `mlx_kvlingo.load` and every command load through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.demo import check_demo_pair


def resolve_translator_spec(spec: str | Path | Translator | None, reverse: bool = False,
                            pair_name: str | None = None, demo_source: str | None = None,
                            models: tuple = (None, None)) -> Path | Translator | None:  # fmt: skip
    """The translator file `spec` names for the direction, read against the demo pair
    `pair_name` and its small model `demo_source` (None: a named pair, the pair's default),
    checked from its header before any model loads (`files.check_file`; `models`: the names of
    the models it maps from and to); a `Translator` as it is."""
    from mlx_kvlingo.models.files import check_file
    from mlx_kvlingo.models.hub import resolve_translator

    if isinstance(spec, Translator):
        return spec
    if pair_name is not None:
        from mlx_kvlingo.models.demo import pair as demo

        try:
            name = None if spec is None else str(spec)
            path = demo.translator_path(name, reverse, pair_name, demo_source)
        except (FileNotFoundError, KeyError):
            if spec is None and reverse:
                return None  # no shipped backward translator: switching back re-reads
            raise
    elif spec is None:
        return None
    else:
        path = resolve_translator(spec, reverse)  # a path, or a Hub id (HubError: neither)
    check_file(path, *models)
    return path


def demo_folders(source, target, translator, backward, demo_pair: str | None) -> tuple:
    """(source, target, demo pair or None, its small model or None): the named models (both, no
    demo pair: else a ValueError), or with neither the demo pair's folders (default "dense", built
    on first use) with the small model the named translator reads (the backward one's when only
    it is named; default: the pair's)."""
    if source is not None or target is not None:
        if source is None or target is None:
            raise ValueError("give both source and target, or neither for the demo pair")
        if demo_pair is not None:
            raise ValueError("a demo pair is chosen by name only without source/target")
        return source, target, None, None
    demo_pair = demo_pair or "dense"
    check_demo_pair(demo_pair)
    from mlx_kvlingo.models.demo import pair as demo

    if translator is not None or backward is None:
        small = demo.source_for(translator, demo_pair)
    else:
        small = demo.source_for(backward, demo_pair, reverse=True)
    return *demo.demo_models(demo_pair, small), demo_pair, small


def load_models_and_translators(source: str | Path | None = None, target: str | Path | None = None,
                                translator: str | Path | Translator | None = None,
                                backward: str | Path | Translator | None = None,
                                demo_pair: str | None = None, *, dtype: Any = "auto",
                                ) -> tuple[Any, Translator | None, Translator | None]:  # fmt: skip
    """(pair, forward, backward): the named pair, or with neither model the demo pair `demo_pair`
    (its shipped translators unless named); each translator checked against its direction."""
    from mlx_kvlingo.models.files import load_translator
    from mlx_kvlingo.models.pair import load_pair

    source, target, demo_pair, small = demo_folders(source, target, translator, backward, demo_pair)
    names = tuple(getattr(m, "name", m) for m in (source, target))  # a LoadedModel's, or as given
    forward = resolve_translator_spec(translator, False, demo_pair, small, names)
    back = resolve_translator_spec(backward, True, demo_pair, small, names[::-1])
    pair = load_pair(source, target, dtype=dtype)
    if isinstance(forward, (str, Path)):
        forward = load_translator(forward, pair)
    if isinstance(back, (str, Path)):
        back = load_translator(back, pair.reversed())
    return pair, forward, back
