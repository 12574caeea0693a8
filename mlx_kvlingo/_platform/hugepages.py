"""Transparent huge pages for glibc's heap, asked for by the `kvlingo` script (`cli.main`).

With `glibc.malloc.hugetlb=1` malloc advises the kernel to back its heap with 2 MB pages where
THP is `madvise`: a long translation's fresh arrays fault once per 2 MB instead of per 4 KB.
glibc reads the tunable at start, so the script re-executes the interpreter with it set
(`reexecute_with_hugepages`, before MLX is imported). Nothing happens off Linux, before glibc
2.35, with THP `always` or `never`, or with KVLINGO_CPU_MEMORY=default; Python API users can
set GLIBC_TUNABLES=glibc.malloc.hugetlb=1 themselves.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: set in the re-executed process, so it never re-executes twice
_GUARD = "KVLINGO_HUGEPAGES_ASKED"


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, or None off glibc."""
    name, version = platform.libc_ver()
    digits = [int(x) for x in version.split(".") if x.isdigit()]
    return (digits[0], digits[1]) if name == "glibc" and len(digits) >= 2 else None


def transparent_hugepages_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's THP mode: 'always', 'madvise', 'never', or None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def tunables_with_hugepages(env: dict) -> dict | None:
    """The environment to re-execute with, or None when huge pages cannot help here."""
    if not sys.platform.startswith("linux") or env.get("KVLINGO_CPU_MEMORY") == "default":
        return None
    if env.get(_GUARD) or "glibc.malloc.hugetlb" in env.get("GLIBC_TUNABLES", ""):
        return None
    version = glibc_version()
    if version is None or version < (2, 35) or transparent_hugepages_mode() != "madvise":
        return None
    tunables = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLE) if t)
    return {**env, "GLIBC_TUNABLES": tunables, _GUARD: "1"}


def hugepages_status(env) -> str:
    """One line for `kvlingo info`: whether this process's heap asks for huge pages."""
    if TUNABLE in env.get("GLIBC_TUNABLES", "").split(":"):
        return f"asked ({TUNABLE}; kernel THP {transparent_hugepages_mode()})"
    mode = transparent_hugepages_mode()
    if mode == "always":
        return "kernel THP always (the heap gets them without asking)"
    if env.get("KVLINGO_CPU_MEMORY") == "default":
        return "not asked (KVLINGO_CPU_MEMORY=default)"
    return f"not asked (kernel THP {mode}, glibc {glibc_version()}; the `kvlingo` script asks)"


def reexecute_with_hugepages() -> None:
    """Replace this process by the same command with the tunable set, where it helps; returns
    (and the caller goes on as is) where it does not or the exec fails."""
    env = tunables_with_hugepages(dict(os.environ))
    if env is not None:
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
        except OSError:
            pass  # run as is: huge pages are an optimization
