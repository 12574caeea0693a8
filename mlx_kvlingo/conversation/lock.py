"""One generation at a time per model pair: the one lock.

Invariant: at most one holder drives a pair's models (a generation from its first token request
to its end, or a change to a conversation: add, trim, save, load, reset); MLX evaluation is never
interleaved from two threads. A holder is a conversation's cache or a server's request
(`owner`) and, for a stream, the stream itself. Asking again from the thread that holds the pair:

    under a plain hold (no stream: a change, a server's request)    -> granted, nested
    for another conversation, or while the holder's stream runs     -> BusyError (no deadlock)
    for the same conversation, its stream left unfinished           -> that stream is closed
                                                                       (it commits what it
                                                                       emitted), then granted

From another thread: wait (up to `timeout` seconds; BusyError after) or, with `wait=False`, a
BusyError at once. A waiter whose `cancel` event is set gives up (`acquire` returns False).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Generator
from typing import Any


class BusyError(RuntimeError):
    """The model pair is in use by another generation (one generation at a time)."""


class Ticket:
    """Who asks for the pair: a conversation's cache, its cancel event, and its stream."""

    __slots__ = ("owner", "cancel", "stream")

    def __init__(self, owner: Any, cancel: threading.Event) -> None:
        self.owner, self.cancel = owner, cancel
        self.stream: weakref.ref[Generator] | None = None


class PairLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: int | None = None
        self._ticket: Ticket | None = None
        self._nested = 0  # grants nested in this thread's plain hold

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def acquire(self, ticket: Ticket, wait: bool = True, timeout: float | None = None) -> bool:
        """Take the pair for `ticket` (the rules in the module docstring); False when its
        `cancel` was set while it waited."""
        me = threading.get_ident()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            stale: Generator | None = None
            with self._cond:
                if self._thread is None:
                    self._thread, self._ticket = me, ticket
                    return True
                held = self._ticket
                if self._thread == me and held is not None and held.stream is None:
                    self._nested += 1
                    return True
                if self._thread == me:
                    gen = held.stream() if held and held.stream else None
                    running = gen is None or getattr(gen, "gi_running", False)
                    if held is None or held.owner is not ticket.owner or running:
                        raise BusyError(
                            "this thread is streaming another conversation of this pair: "
                            "finish that stream or close() it first (one generation at a time)"
                        )
                    stale = gen
                elif not wait:
                    raise BusyError(
                        "the model pair is busy with another generation; retry later, "
                        "or wait=True to wait for it"
                    )
                elif ticket.cancel.is_set():
                    return False
                else:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise BusyError(
                            f"the model pair stayed busy for {timeout} s (another generation)"
                        )
                    self._cond.wait(left)
                    continue
            stale.close()  # commits what it emitted and releases the pair

    def release(self) -> None:
        with self._cond:
            if self._nested:
                self._nested -= 1
                return
            self._thread, self._ticket = None, None
            self._cond.notify_all()

    def wake(self) -> None:
        """Let waiters look at their cancel events again."""
        with self._cond:
            self._cond.notify_all()
