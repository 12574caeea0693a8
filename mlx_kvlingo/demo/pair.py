"""The embedded demo pair, ready to use: models converted/assembled once, translators from weights/."""

from __future__ import annotations

import json
from pathlib import Path

from ..format import load_translator
from ..pair import load_pair
from .data import write_splits
from .smollm2 import cache_root, ensure_demo_source, ensure_smollm2, weights_dir

#: The demo pairs: the same small source; the target is SmolLM2-135M-Instruct ("dense") or
#: its Qwen3-MoE upcycle ("moe", weights/moe/). The manifest lists "moe" under its own key.
PAIRS = ("dense", "moe")


def _check_pair(pair: str) -> None:
    if pair not in PAIRS:
        raise ValueError(f"unknown demo pair {pair!r} (known: {', '.join(PAIRS)})")


def manifest(pair: str = "dense") -> dict:
    """The manifest section of a demo pair (pair, default, translators)."""
    _check_pair(pair)
    path = weights_dir() / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the demo translators have not been built")
    m = json.loads(path.read_text())
    if pair == "dense":
        return m
    if pair not in m:
        raise FileNotFoundError(f"{path} has no translators for the {pair!r} demo pair")
    return m[pair]


def translator_path(name: str | None = None, reverse: bool = False, pair: str = "dense") -> Path:
    """A shipped translator by file name, or the pair's default one for the direction."""
    from ..hub import is_hub_spec, resolve_translator

    if name is not None and is_hub_spec(name):  # org/name[@rev][:file]
        return resolve_translator(name, reverse)
    if name is None:
        name = manifest(pair)["default"]["backward" if reverse else "forward"]
    path = Path(name)
    if not path.exists():
        path = weights_dir() / "translators" / name
    if not path.exists():
        raise FileNotFoundError(f"no translator {name!r} in {weights_dir() / 'translators'}")
    return path


def demo_models(pair: str = "dense") -> tuple[Path, Path]:
    """(source folder, target folder), built on first use."""
    _check_pair(pair)
    if pair == "moe":
        from .moe import ensure_smollm2_moe

        return ensure_demo_source(), ensure_smollm2_moe()
    return ensure_demo_source(), ensure_smollm2()


def load_demo(translator: str | None = None, reverse: bool = False, pair: str = "dense"):
    """(pair, translator) for a demo pair: small -> SmolLM2 (dense or MoE), or the reverse."""
    source, target = demo_models(pair)
    loaded = load_pair(target, source) if reverse else load_pair(source, target)
    return loaded, load_translator(translator_path(translator, reverse, pair), loaded)


def demo_data() -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) chitchat dialogues, split as the demo was trained."""
    return write_splits(cache_root() / "data")


def demo_eval_data() -> Path:
    return demo_data()[1]


def demo_content_texts() -> list[Path]:
    """Held-out Python documentation pages (never calibrated on): the content benchmark's text."""
    folder = weights_dir() / "data"
    return [folder / "pydocs-prose-heldout.jsonl", folder / "pydocs-technical-heldout.jsonl"]
