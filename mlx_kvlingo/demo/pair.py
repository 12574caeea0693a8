"""The embedded demo pair, ready to use: models converted/assembled once, translators from weights/."""

from __future__ import annotations

import json
from pathlib import Path

from ..format import load_translator
from ..pair import load_pair
from .data import write_splits
from .smollm2 import cache_root, ensure_demo_source, ensure_smollm2, weights_dir


def manifest() -> dict:
    path = weights_dir() / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the demo translators have not been built")
    return json.loads(path.read_text())


def translator_path(name: str | None = None, reverse: bool = False) -> Path:
    """A shipped translator by file name, or the default one for the direction."""
    from ..hub import is_hub_spec, resolve_translator

    if name is not None and is_hub_spec(name):  # org/name[@rev][:file]
        return resolve_translator(name, reverse)
    m = manifest()
    if name is None:
        name = m["default"]["backward" if reverse else "forward"]
    path = Path(name)
    if not path.exists():
        path = weights_dir() / "translators" / name
    if not path.exists():
        raise FileNotFoundError(f"no translator {name!r} in {weights_dir() / 'translators'}")
    return path


def demo_models() -> tuple[Path, Path]:
    """(source folder, target folder), built on first use."""
    return ensure_demo_source(), ensure_smollm2()


def load_demo(translator: str | None = None, reverse: bool = False):
    """(pair, translator) for the demo: small -> SmolLM2-135M-Instruct, or the reverse."""
    source, target = demo_models()
    pair = load_pair(target, source) if reverse else load_pair(source, target)
    return pair, load_translator(translator_path(translator, reverse), pair)


def demo_data() -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) chitchat dialogues, split as the demo was trained."""
    return write_splits(cache_root() / "data")


def demo_eval_data() -> Path:
    return demo_data()[1]
