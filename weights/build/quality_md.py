"""One section of weights/QUALITY.md, rewritten between its markers; the rest stays as it is.

translators.py owns the "demo-pair" section (the top table); everything else in the file is
written by hand."""

from __future__ import annotations

from pathlib import Path


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}: begin -->", f"<!-- {section}: end -->"


def write_section(path: Path, section: str, markdown: str, *, first: bool = False) -> None:
    """Replace `section` of the file at `path`, or add it (at the top if `first`, else last)."""
    begin, end = markers(section)
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{markdown.rstrip()}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1]
        text = head + block + (after[1:] if after.startswith("\n") else after)
    elif first:
        text = block + ("\n" + text if text else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
