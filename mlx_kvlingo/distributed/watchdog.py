"""A deadline on blocking collectives, kept by a helper process.

MLX's ring backend holds the GIL while it connects or waits, so no Python thread or signal
handler in the waiting process can run: a peer that never connects, or one that hangs,
would block forever. A tiny child process holds the deadline instead. The parent writes
`arm SECONDS MESSAGE` / `disarm` lines to its stdin; if a deadline passes while armed, the
child prints MESSAGE on the shared stderr and terminates the parent. When the parent exits,
the child reads end-of-file and exits too.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from contextlib import contextmanager

_CHILD = r"""
import os, select, signal, sys, time
ppid, fd, buf, deadline, msg = int(sys.argv[1]), sys.stdin.fileno(), b"", None, ""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([fd], [], [], wait)
    if ready:
        chunk = os.read(fd, 65536)
        if not chunk:
            sys.exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd, _, rest = line.decode().partition(" ")
            if cmd == "arm":
                secs, _, msg = rest.partition(" ")
                deadline = time.monotonic() + float(secs)
            else:
                deadline = None
    elif deadline is not None and time.monotonic() >= deadline:
        sys.stderr.write(msg.replace("\\n", "\n") + "\n")
        sys.stderr.flush()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(ppid, sig)
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(2)
        sys.exit(0)
"""

_proc: subprocess.Popen | None = None


def _child() -> subprocess.Popen:
    global _proc
    if _proc is None or _proc.poll() is not None:
        _proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE, bufsize=0
        )
        atexit.register(_stop, _proc)
    return _proc


def _send(line: str) -> None:
    p = _child()
    try:
        p.stdin.write((line.replace("\n", "\\n") + "\n").encode())
    except BrokenPipeError:  # the child died: run without a deadline rather than fail
        pass


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()  # the child exits at end-of-file
    proc.wait()


@contextmanager
def deadline(seconds: float | None, message: str):
    """Terminate this process with `message` on stderr if the block runs past `seconds`."""
    if not seconds:
        yield
        return
    _send(f"arm {float(seconds)} {message}")
    try:
        yield
    finally:
        _send("disarm")
