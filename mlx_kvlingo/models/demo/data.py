"""Offline dialogue data for the demo pair: the `chitchat-dataset` PyPI package (MIT).

Dialogues are split once by a stable hash of their id: 1 in 20 is held out, and held-out
dialogues are used neither to heal the demo source nor to calibrate its translators.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text

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


def write_splits(folder: Path) -> tuple[Path, Path]:
    """Write train.jsonl and heldout.jsonl ({"messages": [...]} per line) once; return paths."""
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
