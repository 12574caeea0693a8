"""Every error a user can cause, as one line: the one place `kvlingo` maps exceptions to messages.

`user_errors` (around every command) turns an error the user caused (`message`) into one line
naming the thing and what to do (exit status 2 for usage errors, else 1); a programming error
keeps its traceback. `--debug` / `KVLINGO_DEBUG=1` shows every traceback.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

DEBUG_ENV = "KVLINGO_DEBUG"
#: the packages whose own exception classes are refusals written for the user
OWN_PACKAGES = ("mlx_kvlingo", "kvlingo_converters", "converters")
#: MLX's file readers and writers report a bad or unwritable file as a RuntimeError like these
_MLX_IO = re.compile(r"^\[(load|save|read|write|open)\w*\]")
_OS_HINTS = {FileNotFoundError: "check the path",
             PermissionError: "check its permissions, or choose another place",
             IsADirectoryError: "give a file, not a folder",
             NotADirectoryError: "a part of the path is a file, not a folder"}  # fmt: skip
#: file suffixes worth naming when an error does not say which file it read
_FILE_SUFFIXES = {".json", ".jsonl", ".safetensors", ".gguf", ".npz", ".txt", ".md", ".rst"}


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line (`Error: ... (see: kvlingo CMD --help)`), exit status 2."""

    def show(self, file=None) -> None:
        hint = f" (see: {self.ctx.command_path} --help)" if self.ctx is not None else ""
        click.echo(f"Error: {one_line(self.format_message())}{hint}", file=file, err=file is None)


def _own(e: BaseException) -> bool:
    mro = [c for c in type(e).__mro__ if c not in (BaseException, Exception)]
    return any(c.__module__.split(".")[0] in OWN_PACKAGES for c in mro)


def _frames(e: BaseException) -> list:
    """The frames `e` passed through, innermost first."""
    return [frame for frame, _ in traceback.walk_tb(e.__traceback__)][::-1]


def _file_read(e: BaseException) -> str | None:
    """The file (an open one, or a path of a data or weights kind) an error without a file name
    was reading, from the frames it passed through."""
    for frame in _frames(e):
        for value in frame.f_locals.values():
            name = getattr(value, "name", None) if hasattr(value, "read") else None
            if isinstance(name, str) and Path(name).is_file():
                return name
            if isinstance(value, str | Path) and len(str(value)) < 4096:
                p = Path(value)
                if p.suffix in _FILE_SUFFIXES and p.is_file():
                    return str(p)
    return None


def _corrupt(e: Exception, what: str) -> str:
    file = _file_read(e)
    where = f"{file}: " if file else ""
    hint = "an incomplete download or a damaged file? fetch or write it again"
    return f"{where}{what} ({one_line(e)[:300]}); {hint}"


def message(e: BaseException) -> str | None:
    """The one-line message for an error the user caused, or None for a programming error."""
    if not isinstance(e, Exception) or isinstance(e, click.exceptions.Exit | click.Abort):
        return None
    if isinstance(e, click.ClickException):
        return one_line(e.format_message())
    if _own(e):  # a refusal of this package: its message names the file and what is wrong
        return one_line(e)
    if type(e).__module__.startswith("huggingface_hub"):  # some are OSErrors too
        from mlx_kvlingo.models.hub import explain

        # the Hub id: a string local `repo_id` in the frames `e` passed through, innermost first
        repo = [v for f in _frames(e) if isinstance(v := f.f_locals.get("repo_id"), str)]
        return explain(e, repo[0] if repo else "the Hub repository") or one_line(e)
    if isinstance(e, OSError) and e.filename is None:
        return str(e)  # our own OSErrors (an atomic save that could not write) say what failed
    if isinstance(e, OSError):
        what = e.filename if e.filename2 is None else f"{e.filename} -> {e.filename2}"
        hint = _OS_HINTS.get(type(e))
        return f"{what}: {e.strerror or e}" + (f"; {hint}" if hint else "")
    if type(e).__name__ == "SafetensorError":
        return _corrupt(e, "not a valid safetensors file")
    if isinstance(e, RuntimeError) and _MLX_IO.match(str(e)):
        return _corrupt(e, "cannot read or write this file")
    if isinstance(e, json.JSONDecodeError):
        return _corrupt(e, f"not valid JSON at line {e.lineno} column {e.colno}")
    if isinstance(e, UnicodeDecodeError):
        return _corrupt(e, "not UTF-8 text")
    # a ValueError raised on purpose (a `raise` statement) by our code or mlx-lm's loader
    last = traceback.extract_tb(e.__traceback__)[-1:]
    if type(e) is ValueError and last and (last[0].line or "").startswith("raise"):
        where = Path(last[0].filename).as_posix()
        if any(f"/{p}/" in where for p in OWN_PACKAGES) or where.endswith("/mlx_lm/utils.py"):
            return one_line(e)
    return None


@contextlib.contextmanager
def user_errors(ctx: click.Context | None = None) -> Iterator[None]:
    """Errors the user caused as one-line click errors (with --debug, their tracebacks too)."""
    try:
        yield
    except Exception as e:
        if ctx is not None and ctx.find_root().params.get("debug"):  # --debug or KVLINGO_DEBUG
            if not isinstance(e, click.ClickException):
                raise  # the whole traceback
            cause = e.__cause__ or e.__context__
            if cause is not None:  # a command's `raise ClickException(...) from None`
                traceback.print_exception(type(cause), cause, cause.__traceback__)
                sys.stderr.flush()
        text = message(e)
        if text is None:
            raise
        if isinstance(e, click.UsageError):  # exit status 2
            raise OneLineUsageError(text, e.ctx) from e
        out = click.ClickException(text)
        out.exit_code = e.exit_code if isinstance(e, click.ClickException) else 1
        raise out from e
