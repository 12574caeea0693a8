"""Plain-prose and technical text for calibration and per-domain evaluation, from the Python
documentation sources in Debian's `python3.11-doc` package (`apt-get install python3.11-doc`;
PSF License Version 2, examples also Zero-Clause BSD: see weights/data/LICENSE-python-docs).

  prose      narrative pages: the tutorial, the HOWTOs and the FAQ
  technical  the library reference (module pages)

reST markup is reduced to plain text (directives, code blocks, tables and link targets dropped,
roles kept as their text). The split is by page: a page is held out when
sha1(path) % 5 == 0, and a held-out page never contributes calibration text. Writes
`{domain}-{train,heldout}.jsonl` (one {"text": ...} record per page) to --out (default
~/.cache/mlx-kvlingo/data/pydocs) and, with --ship, the held-out files trimmed to --ship-chars
characters per domain into weights/data/ (so evaluation needs no apt package).

    python -m weights.build.text_data --ship
    python -m weights.build.text_data --mix-chat 1000   # + the mixed stage-2 folder

`--mix-chat N` also writes ~/.cache/mlx-kvlingo/data/mixed-issue20/: the first N dialogues of
the demo's chitchat training split beside the prose and technical training pages (the data of
the mixed-text stage-2 run in weights/QUALITY.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DOMAINS = {"prose": ("tutorial", "howto", "faq"), "technical": ("library",)}
WEIGHTS = Path(__file__).resolve().parents[1]

_ROLE = re.compile(r":[\w:+-]+:`(?:[^`<]*<)?([^`>]*)>?`")  # :ref:`text <target>` -> text
_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`_+")


def plain(rst: str) -> str:
    """Paragraph text of a reST page: directives, literal blocks and tables dropped."""
    out, skipping = [], False
    lines = rst.splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if skipping:  # inside a directive or literal block: until a non-indented line
            if s and not line[0].isspace():
                skipping = False
            else:
                continue
        if s.startswith(".."):
            skipping = True
            continue
        if s and set(s) <= set("=-~^*#+`'\"_:.") and len(s) > 2:
            continue  # section underline / table border
        if s.startswith((">>>", "...", "|", "+-")):
            continue
        if line[:1].isspace() and s:
            continue  # indented: code, definition bodies
        if s.endswith("::"):
            s = s[:-1] if s != "::" else ""
            skipping = bool(i + 1 < len(lines))
        s = _ROLE.sub(r"\1", s)
        s = _LINK.sub(r"\1", s)
        s = s.replace("``", "").replace("**", "")
        out.append(s)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 5 == 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--docs", type=Path, default=DOCS)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/mlx-kvlingo/data/pydocs")
    ap.add_argument("--min-chars", type=int, default=1500)
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--ship-chars", type=int, default=60_000)
    ap.add_argument("--mix-chat", type=int, default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.docs.is_dir():
        raise SystemExit(f"{args.docs}: missing; apt-get install python3.11-doc")
    args.out.mkdir(parents=True, exist_ok=True)
    for domain, folders in DOMAINS.items():
        split = {"train": [], "heldout": []}
        for folder in folders:
            for page in sorted((args.docs / folder).glob("*.rst.txt")):
                rel = str(page.relative_to(args.docs))
                text = plain(page.read_text(encoding="utf-8"))
                if len(text) >= args.min_chars:
                    split["heldout" if is_heldout(rel) else "train"].append({"text": text, "page": rel})  # fmt: skip
        for name, records in split.items():
            path = args.out / f"{domain}-{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            chars = sum(len(r["text"]) for r in records)
            print(f"{path}: {len(records)} pages, {chars} characters")
        if args.ship:
            kept, total = [], 0
            for r in split["heldout"]:
                if total >= args.ship_chars:
                    break
                kept.append({"text": r["text"][: args.ship_chars - total], "page": r["page"]})
                total += len(kept[-1]["text"])
            ship = WEIGHTS / "data" / f"pydocs-{domain}-heldout.jsonl"
            ship.write_text("".join(json.dumps(r) + "\n" for r in kept))
            print(f"{ship}: {len(kept)} pages, {total} characters")
    if args.mix_chat:
        from mlx_kvlingo.models.demo.pair import demo_data

        mixed = args.out.parent / "mixed-issue20"
        mixed.mkdir(parents=True, exist_ok=True)
        chat = demo_data()[0].read_text().splitlines(keepends=True)[: args.mix_chat]
        (mixed / "chat-train.jsonl").write_text("".join(chat))
        for domain in DOMAINS:
            (mixed / f"{domain}-train.jsonl").write_text(
                (args.out / f"{domain}-train.jsonl").read_text()
            )
        print(f"{mixed}: {len(chat)} dialogues + prose and technical training pages")


if __name__ == "__main__":
    main()
