"""The public API under stress: T threads x N random operations over one loaded pair.

Each thread owns two conversations and, until a global deadline, draws operations at random:
send (model small or large, greedy, a few tokens; sometimes `wait=False` or a short `timeout`),
cancel (another thread's conversation, from this thread), escalate, save, restore (into a new
conversation, or `load` into this one), reset, trim. After every operation, holding the pair,
the invariants are checked:

    each model's cache holds exactly the tokens the session says it holds (every layer's offset
    equals `held`, and `held` <= the conversation's length);
    the conversation's tokens agree with its messages (each message's content appears in the
    decoded tokens, in order; no tokens: at most the system prompt, templated with the first
    message) and, once every thread is done, nothing holds the pair.

Errors a caller is told to expect are counted by class (`ConversationError` for a request that
cannot be honoured, e.g. nothing to escalate or a context that is full; `BusyError` for
`wait=False` or a timeout); anything else, an invariant that fails, or a thread still running
after the deadline (a deadlock) is a failure.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

OPS = ("send", "send", "send", "cancel", "escalate", "save", "restore", "reset", "trim")
TEXTS = ["def parse_args(argv):", "class Foo(object):", "import json\nimport os", "print(x)",
         "What is a KV cache?", "return self", "", "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600"]  # fmt: skip


@dataclass
class StressReport:
    threads: int
    ops_per_thread: int
    ops: Counter = field(default_factory=Counter)  # completed operations by kind
    errors: Counter = field(default_factory=Counter)  # expected errors by class
    failures: list = field(default_factory=list)  # unexpected errors, broken invariants
    deadlocked: bool = False
    seconds: float = 0.0
    tokens: int = 0  # tokens generated
    slowest_op_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def ops_per_s(self) -> float:
        return self.total / self.seconds if self.seconds else 0.0


def check_invariants(conv) -> None:
    """Raise AssertionError when a conversation's caches, tokens and messages disagree."""
    s = conv.cache
    for role in ("source", "target"):
        held = s.held(role)
        offsets = {c.offset for c in s.cache(role)}
        assert offsets <= {held}, f"{role}: cache offsets {sorted(offsets)} != held {held}"
        assert 0 <= held <= len(s.tokens), f"{role} holds {held} of {len(s.tokens)} tokens"
    if not s.tokens:  # the system prompt is templated with the first message
        assert all(m["role"] == "system" for m in s.messages), "messages without tokens"
        return
    text = s.pair.tokenizer.decode(s.tokens)
    at = 0
    for m in s.messages:
        i = text.find(m["content"], at)
        assert i >= 0, f"message {m['role']} {m['content'][:40]!r} not in the conversation's tokens"
        at = i + len(m["content"])


def _worker(tid, runtime, convs, all_convs, rng, n_ops, deadline, folder, report, lock):
    from mlx_kvlingo import BusyError, Conversation, ConversationError, load_prompt_cache
    from mlx_kvlingo.api import _held

    saved: list[Path] = []
    for k in range(n_ops):
        if time.monotonic() > deadline:
            return
        op = rng.choice(OPS)
        ci = rng.randrange(len(convs))
        conv = convs[ci]
        t0 = time.perf_counter()
        generated = 0
        try:
            if op == "send":
                kw = {"model": rng.choice(["small", "large"]), "max_tokens": rng.randint(1, 6),
                      "temp": 0}  # fmt: skip
                r = rng.random()
                if r < 0.1:
                    kw["wait"] = False
                elif r < 0.2:
                    kw["timeout"] = 0.05
                for ev in conv.send(rng.choice(TEXTS), **kw):
                    generated += ev.token is not None
                    if rng.random() < 0.05:  # stop early from this thread
                        break
            elif op == "cancel":
                other = rng.choice(all_convs)
                other.cancel()
            elif op == "escalate":
                for ev in conv.send(escalate=True, max_tokens=rng.randint(1, 4), temp=0):
                    generated += ev.token is not None
            elif op == "save":
                path = folder / f"t{tid}-{k}.safetensors"
                saved.append(conv.save(path))
            elif op == "restore":
                if not saved:
                    op = "restore (nothing saved)"
                elif rng.random() < 0.5:
                    cache = load_prompt_cache(rng.choice(saved), runtime)
                    convs[ci] = Conversation(runtime, prompt_cache=cache)
                    with lock:
                        all_convs.append(convs[ci])
                    conv = convs[ci]
                else:
                    conv.load(rng.choice(saved))
            elif op == "reset":
                conv.reset()
            elif op == "trim":
                n = rng.choice([8, 16, 32, 64])
                conv.trim(n)
            _held(conv.cache, lambda c=conv: check_invariants(c), True, 60)
            with lock:
                report.ops[op] += 1
        except (ConversationError, BusyError) as e:
            with lock:
                report.ops[op] += 1
                report.errors[type(e).__name__] += 1
            try:
                _held(conv.cache, lambda c=conv: check_invariants(c), True, 60)
            except AssertionError as a:
                with lock:
                    report.failures.append((tid, k, op, f"after {type(e).__name__}: {a}"))
        except AssertionError as e:
            with lock:
                report.failures.append((tid, k, op, f"invariant: {e}"))
        except Exception as e:  # noqa: BLE001 - the finding
            with lock:
                report.failures.append((tid, k, op, f"{type(e).__name__}: {e}\n"
                                        f"{traceback.format_exc(limit=-4)}"))  # fmt: skip
        with lock:
            report.tokens += generated
            report.slowest_op_s = max(report.slowest_op_s, time.perf_counter() - t0)


def stress(runtime, folder: Path, *, threads: int = 8, ops: int = 50, seed: int = 0,
           timeout: float = 600.0, conversations_per_thread: int = 2) -> StressReport:  # fmt: skip
    """Run the campaign; `timeout`: the global deadline (threads alive after it: deadlock)."""
    from mlx_kvlingo import Conversation

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    report = StressReport(threads, ops)
    lock = threading.Lock()
    owned = [
        [Conversation(runtime, rng_kv(t, j), system_prompt="Be brief." if (t + j) % 2 else None)
         for j in range(conversations_per_thread)]
        for t in range(threads)
    ]  # fmt: skip
    all_convs = [c for cs in owned for c in cs]
    deadline = time.monotonic() + timeout
    workers = [
        threading.Thread(
            target=_worker, daemon=True, name=f"stress-{t}",
            args=(t, runtime, owned[t], all_convs, random.Random(f"{seed}:{t}"), ops, deadline,
                  folder, report, lock),
        )
        for t in range(threads)
    ]  # fmt: skip
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()) + 30)
    report.seconds = time.perf_counter() - t0
    report.deadlocked = any(w.is_alive() for w in workers)
    if not report.deadlocked:
        for conv in list(all_convs):
            try:
                check_invariants(conv)
            except AssertionError as e:
                report.failures.append((-1, -1, "final", f"invariant: {e}"))
        if runtime.busy:
            report.failures.append(
                (-1, -1, "final", "the pair is still held after every thread ended")
            )
    return report


def rng_kv(t: int, j: int) -> int | None:
    """Some conversations have a small context, so ContextOverflowError and trim get exercised."""
    return 96 if (t + j) % 3 == 0 else None
