"""Progress, drawn by the faces: the library reports `progress(done, total)` (mlx-lm's prompt
progress callback shape; stage 2 adds a note, its loss and speed) and draws nothing; here one
transient rich bar draws those calls. A caller that passes no callback sees nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(label: str, console: Console | None = None) -> Iterator[Callable[..., None]]:
    """`progress(done, total, note="")` drawing one bar labelled `label`, gone when it ends."""
    columns = (TextColumn(label), BarColumn(), TextColumn("{task.fields[count]}"),
               TextColumn("{task.fields[note]}"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None, count="", note="")
        yield lambda done, total, note="": bar.update(
            task, completed=done, total=total, count=f"{done:,}/{total:,}", note=note
        )
