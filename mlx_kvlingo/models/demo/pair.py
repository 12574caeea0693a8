"""The embedded demo pair, ready to use: models converted/assembled once, translators from weights/."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo.models.demo import check_demo_pair
from mlx_kvlingo.models.demo.smollm2 import (
    DEMO_SOURCES,
    cache_root,
    ensure_demo_source,
    ensure_smollm2,
    missing_weights,
    source_files,
    weights_dir,
)
from mlx_kvlingo.models.files import TranslatorFileError, load_translator, read_metadata
from mlx_kvlingo.models.pair import load_pair

#: The small model a pair uses unless its manifest's default names another (`default.source`):
#: the 15-layer `weights/source15/`, the only one shipped.
FIRST_SOURCE = "source15"


def manifest(pair: str = "dense") -> dict:
    """The demo translators' manifest (pair, default, translators): the same for both pairs,
    the MoE target's K/V being the dense target's (demo/moe.py)."""
    check_demo_pair(pair)
    path = weights_dir() / "manifest.json"
    if not path.exists():
        raise missing_weights(path, "translators")
    return json.loads(path.read_text())


def shipped_retention(path, large_reads_last: int, recompute_share: float) -> dict | None:
    """The content retention the demos' default forward translator file `path` ships with
    (manifest `default.retention`: {"large_reads_last", "recompute_share", "counts": [[read
    length, kept, right], ...], "source"}) for these reader settings; else None."""
    try:
        r = manifest()["default"].get("retention")
        if not r or Path(path).resolve() != translator_path().resolve():
            return None
        settings = (r.get("large_reads_last"), r.get("recompute_share"))
    except (FileNotFoundError, KeyError, ValueError, OSError, AttributeError):
        return None
    return r if settings == (large_reads_last, recompute_share) else None


def default_source(pair: str = "dense") -> str:
    """The demo source (a `weights/` folder) the pair's default translators read."""
    try:
        return manifest(pair)["default"].get("source", FIRST_SOURCE)
    except FileNotFoundError:  # no translators built yet (weights/build, step 2)
        return FIRST_SOURCE


def defaults(pair: str = "dense", source: str | None = None) -> dict:
    """{"forward": file, "backward": file} shipped for the pair with that demo source (the
    manifest's `default` for its default source, else `by_source[source]`)."""
    m = manifest(pair)
    if source is None or source == m["default"].get("source", FIRST_SOURCE):
        return m["default"]
    if source not in m.get("by_source", {}):
        raise FileNotFoundError(f"the {pair!r} demo pair ships no translators for {source!r}")
    return m["by_source"][source]


def translator_path(name: str | None = None, reverse: bool = False, pair: str = "dense",
                    source: str | None = None) -> Path:  # fmt: skip
    """A file, a shipped translator by file name, a Hub id (`hub.parse_spec`), or the default one
    for the direction and the demo source `source` (None: the pair's default source)."""
    from mlx_kvlingo.models.hub import parse_spec, resolve_translator

    named = name is not None
    name = name if named else defaults(pair, source)["backward" if reverse else "forward"]
    for path in (Path(name), weights_dir() / "translators" / name):
        if path.exists():
            return path
    if named and parse_spec(name):
        return resolve_translator(name, reverse)
    raise FileNotFoundError(
        f"{name}: no such translator file, nor a demo translator in {weights_dir() / 'translators'}"
    )


def source_for(translator=None, pair: str = "dense", reverse: bool = False) -> str:
    """The demo source with as many layers as the small side of `translator` (a shipped name, a
    file or a `Translator`; None: the pair's default source)."""
    if translator is None:
        return default_source(pair)
    from mlx_kvlingo.kv.translator import Translator

    small, large = ("target", "source") if reverse else ("source", "target")
    if isinstance(translator, Translator):
        layers, other = (getattr(translator.config, k).layers for k in (small, large))
    else:
        meta = read_metadata(translator_path(str(translator), reverse, pair))
        layers, other = meta[small]["layers"], meta[large]["layers"]
    known = {}
    for folder in DEMO_SOURCES:
        try:
            known[folder] = len(json.loads(source_files(folder)[1].read_text())["kept_layers"])
        except FileNotFoundError:
            continue
        if known[folder] == layers:
            return folder
    shapes = ", ".join(f"{f} ({n} layers)" for f, n in known.items())
    if other in known.values():
        way, give = ("small -> large", "forward") if reverse else ("large -> small", "backward")
        raise TranslatorFileError(
            f"translator {translator!r} reads a {layers}-layer small model: it goes the other "
            f"way ({way}); give it as the {give} translator (the demo's small models: {shapes})"
        )
    raise TranslatorFileError(
        f"translator {translator!r} reads a {layers}-layer small model; the demo's are {shapes}"
    )


def demo_models(pair: str = "dense", source: str | None = None) -> tuple[Path, Path]:
    """(source folder, target folder), built on first use; `source`: which `weights/<source>/`
    (None: the pair's default)."""
    check_demo_pair(pair)
    small = ensure_demo_source(folder=source or default_source(pair))
    if pair == "moe":
        from mlx_kvlingo.models.demo.moe import ensure_smollm2_moe

        return small, ensure_smollm2_moe()
    return small, ensure_smollm2()


def load_demo(translator: str | None = None, reverse: bool = False, pair: str = "dense"):
    """(pair, translator) for a demo pair, small -> large or the reverse; the small model is the
    demo source the translator reads (`source_for`)."""
    folder = source_for(translator, pair, reverse)
    source, target = demo_models(pair, folder)
    loaded = load_pair(target, source) if reverse else load_pair(source, target)
    return loaded, load_translator(translator_path(translator, reverse, pair, folder), loaded)


#: The demo's dialogues (the `chitchat-dataset` PyPI package, MIT) are split once by a stable hash
#: of their id: 1 in HELDOUT_EVERY is held out, used neither to heal the demo source nor to
#: calibrate its translators.
HELDOUT_EVERY = 20


def chitchat_dialogues() -> dict:
    """{id: {"messages": [[msg, ...], ...]}} from the installed chitchat-dataset package."""
    try:
        dist = importlib.metadata.distribution("chitchat-dataset")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the demo data comes from the chitchat-dataset package: pip install "
                                "chitchat-dataset") from None  # fmt: skip
    return json.loads(Path(dist.locate_file("chitchat_dataset/dataset.json")).read_text())


def to_messages(conv: dict) -> list[dict]:
    """Turns alternate user/assistant; the first speaker is the user."""
    turns = conv["messages"]
    first = turns[0][0]["sender"]
    return [{"role": "user" if turn[0]["sender"] == first else "assistant",
             "content": "\n".join(m["text"].strip() for m in turn)} for turn in turns]  # fmt: skip


def is_heldout(conv_id: str) -> bool:
    return int(hashlib.sha1(conv_id.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def demo_data() -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) chitchat dialogues ({"id", "messages"} per line), split as
    the demo was trained; written once into the cache."""
    folder = cache_root() / "data"
    folder.mkdir(parents=True, exist_ok=True)
    train, held = folder / "chitchat-train.jsonl", folder / "chitchat-heldout.jsonl"
    if train.exists() and held.exists():
        return train, held
    dialogues = chitchat_dialogues()
    lines = {True: [], False: []}
    for k in sorted(k for k in dialogues if dialogues[k]["messages"]):
        lines[is_heldout(k)].append(json.dumps({"id": k, "messages": to_messages(dialogues[k])}))
    for path, rows in ((train, lines[False]), (held, lines[True])):
        write_text(path, "\n".join(rows) + "\n")
    return train, held


def demo_content_texts() -> list[Path]:
    """Held-out Python documentation pages (never calibrated on): the content benchmark's text."""
    folder = weights_dir() / "data"
    return [folder / "pydocs-prose-heldout.jsonl", folder / "pydocs-technical-heldout.jsonl"]
