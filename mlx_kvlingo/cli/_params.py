"""Parameter types that refuse a bad value before any model loads, naming the option (exit
status 2). They judge the value as typed (a path that exists, of the right kind; a well-formed
Hub id); a file's content, or a Hub id not to be had, is refused where it is read, by
`errors.py` (exit status 1)."""

from __future__ import annotations

import os
from pathlib import Path

import click


def looks_like_path(value: str) -> bool:
    """Written as a path (absolute, ./, ../ or ~), so never a Hub id or a demo name."""
    return value.startswith(("/", "./", "../", "~", ".\\", "..\\")) or value in (".", "..")


class ModelSpec(click.ParamType):
    """A model: a local folder mlx-lm can load, or a Hub id (org/name). Beside a demo pair
    (`--pair`, an eager option, so read first whatever the order typed) it is a wrong
    combination, refused before the model itself is judged."""

    name = "model"

    def convert(self, value, param, ctx):
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        if not isinstance(value, str):
            return value
        if ctx is not None and ctx.params.get("demo_pair", "dense") != "dense":
            raise click.UsageError("--pair chooses a demo pair: not with --small/--large", ctx)
        path = Path(value).expanduser()
        if path.is_file():
            problem = f"{value} is a file, not a model folder (config.json and *.safetensors)"
            self.fail(problem, param, ctx)
        if not path.exists() and looks_like_path(value):
            self.fail(f"{value}: no such folder", param, ctx)
        if not path.exists():
            try:  # a Hub id's files: judged where fetched
                validate_repo_id(value)
            except HFValidationError:
                self.fail(f"{value}: no such folder, and not a Hub id (org/name)", param, ctx)
        return value


class TranslatorSpec(click.ParamType):
    """A translator: a .safetensors file, a Hub id org/name[@revision][:file], or (with a demo
    pair) a demo translator's name, judged when the pair loads."""

    name = "translator"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        path = Path(value).expanduser()
        if path.is_dir():
            self.fail(f"{value} is a folder, not a translator file (.safetensors)", param, ctx)
        if not path.exists() and looks_like_path(value):
            self.fail(f"{value}: no such file", param, ctx)
        return value


class OutputFile(click.Path):
    """A file to write (`OutputFolder`: a folder, created if missing), not the other kind, under
    a folder that exists and can be written."""

    folder = False

    def __init__(self, **kw):
        super().__init__(file_okay=not self.folder, dir_okay=self.folder, **kw)

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        path = Path(os.fsdecode(value)).expanduser()
        up = path if self.folder else path.parent
        while self.folder and not up.exists() and up.parent != up:
            up = up.parent
        if not up.is_dir():
            what = "is a file" if up.exists() else "does not exist"
            self.fail(f"cannot write {path}: the folder {up} {what}", param, ctx)
        if not os.access(up, os.W_OK):
            self.fail(f"cannot write {path}: the folder {up} is not writable", param, ctx)
        return value


class OutputFolder(OutputFile):
    folder = True


class NumberList(click.ParamType):
    """Comma-separated numbers of `kind` (int or float), each at least `least` (above it with
    `open_least`) and at most `most`, as a sorted tuple without repeats; '' is none where
    `empty` allows it."""

    def __init__(self, kind: type = float, least: float = 0.0, most: float | None = None, *,
                 open_least: bool = False, empty: bool = False):  # fmt: skip
        self.kind, self.least, self.most = kind, least, most
        self.open_least, self.empty = open_least, empty
        self.name = "integers" if kind is int else "numbers"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            items = tuple(sorted({self.kind(v) for v in value.split(",") if v.strip()}))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.name}", param, ctx)
        if not items and not self.empty:
            self.fail(f"give at least one {self.name[:-1]}", param, ctx)
        if items and (items[0] <= self.least if self.open_least else items[0] < self.least):
            bound = "above" if self.open_least else "at least"
            self.fail(f"{value!r}: every value must be {bound} {self.least:g}", param, ctx)
        if self.most is not None and items and items[-1] > self.most:
            self.fail(f"{value!r}: every value must be at most {self.most:g}", param, ctx)
        return items


class ChoiceList(click.ParamType):
    """Comma-separated names out of `choices`, in the order given, without repeats."""

    name = "names"

    def __init__(self, choices):
        self.choices = tuple(choices)

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        items = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
        bad = [v for v in items if v not in self.choices]
        if bad or not items:
            expected = ", ".join(self.choices)
            self.fail(f"{', '.join(bad) or 'none'}: expected some of {expected}", param, ctx)
        return items


#: kept shares of speculative prefill (bench, eval --task content): in (0, 1], '' for none
KEPT_SHARES = NumberList(float, 0.0, 1.0, open_least=True, empty=True)
