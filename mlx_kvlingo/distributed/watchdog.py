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
from contextlib import contextmanager, suppress

_CHILD = r"""
import os, sys, threading, time
def fire(message):
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    for sig in (15, 9):  # SIGTERM, then SIGKILL
        try:
            os.kill(int(sys.argv[1]), sig)
        except ProcessLookupError:
            break
        time.sleep(2)
    os._exit(0)
timer = None
for line in sys.stdin:  # until the parent's end-of-file
    if timer is not None:
        timer.cancel()
    cmd, _, rest = line.rstrip("\n").partition(" ")
    if cmd == "arm":
        secs, _, message = rest.partition(" ")
        timer = threading.Timer(float(secs), fire, (message,))
        timer.daemon = True
        timer.start()
"""

_proc: subprocess.Popen | None = None


def _send(line: str) -> None:
    """A line to the child, started on first use (it exits at this process's end-of-file)."""
    global _proc
    if _proc is None or _proc.poll() is not None:
        _proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE, bufsize=0
        )
        atexit.register(_proc.stdin.close)
    with suppress(BrokenPipeError):  # the child died: run without a deadline rather than fail
        _proc.stdin.write((line.replace("\n", " ") + "\n").encode())


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
