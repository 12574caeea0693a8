"""weights/manifest.json, the one file every build script adds to: `merge_rows` is its only writer.

The manifest has one part per demo pair: the dense pair's at the top level, the MoE pair's under
"moe". Each part lists translator rows (keyed by "file"), names a default per direction
("default") and records the command that built it. A writer owns only the rows it has just
built: it replaces those, adds new ones and keeps every other row, every other part and the
existing defaults. A default changes only when the writer is told to change it (`default=`), or
where a direction has none yet (`initial_default=`); the one it replaces is kept as
"previous_default". The file is replaced atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text


def merge_rows(
    path: Path,
    rows: list[dict],
    *,
    section: str | None = None,
    fields: dict | None = None,
    default: dict | None = None,
    initial_default: dict | None = None,
    demo_source: str | None = None,
    default_source: bool = False,
) -> dict:
    """Merge `rows` into `section` (None: the top level) of the manifest at `path` and write it.

    `fields` (e.g. "pair", "command") are set on that part; `default` ({direction: file}) sets
    those defaults; `initial_default` only fills directions that have none. Returns the manifest.
    `demo_source`: the demo small model (`weights/<folder>`) the rows read; `default` and
    `initial_default` then set that source's defaults: the part's "default" when it is the
    part's default source, else "by_source"[folder] (and `fields` are not set: they describe
    the part's default source). `default_source`: make it the part's default source; the
    defaults of the one it replaces move to "by_source".
    """
    manifest = json.loads(path.read_text()) if path.exists() else {}
    part = manifest if section is None else manifest.setdefault(section, {})
    mine = {r["file"] for r in rows}
    part["translators"] = [r for r in part.get("translators", []) if r["file"] not in mine] + rows
    if demo_source is not None:
        current = (part.get("default") or {}).get("source", "source")
        if default_source and demo_source != current:
            by_source = part.setdefault("by_source", {})
            by_source[current] = {k: v for k, v in (part.get("default") or {}).items()
                                  if k != "source"}  # fmt: skip
            part["previous_default"] = part.get("default") or {}
            part["default"] = {**by_source.pop(demo_source, {}), "source": demo_source}
        elif demo_source != current:
            own = part.setdefault("by_source", {}).setdefault(demo_source, {})
            own.update({d: f for d, f in (initial_default or {}).items() if f and not own.get(d)})
            own.update({d: f for d, f in (default or {}).items() if f})
            write_text(path, json.dumps(manifest, indent=1))
            return manifest
    part.update(fields or {})
    old = dict(part.get("default") or {})
    new = {d: f for d, f in (initial_default or {}).items() if f and not old.get(d)}
    new |= {d: f for d, f in (default or {}).items() if f}
    if any(old.get(d) and old[d] != f for d, f in new.items()):
        part["previous_default"] = old
    if new.get("forward", old.get("forward")) != old.get("forward"):
        # measured for the forward file that leaves the default (previous_default keeps it)
        old = {k: v for k, v in old.items() if k != "retention"}
    part["default"] = {**old, **new}
    write_text(path, json.dumps(manifest, indent=1))
    return manifest
