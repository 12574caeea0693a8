"""The public API, shaped as mlx-lm's: `load`, `stream_generate`, `generate`, `make_prompt_cache`,
`save_prompt_cache`, `load_prompt_cache`, and `Conversation` for apps.

    from mlx_kvlingo import load, make_prompt_cache, stream_generate

    pair = load()                                  # the demo pair; or load(small, large, translator)
    cache = make_prompt_cache(pair)                # both models' caches and the conversation
    for r in stream_generate(pair, "Hello", prompt_cache=cache, max_tokens=64):
        print(r.text, end="")                      # mlx-lm's fields; the last one: r.handoff, r.status

`prompt`: a str is a user message, chat-templated as a turn of the conversation; a list of token
ids is appended as it is (no template); None answers what the cache holds unanswered. By default
the large model answers and the small one reads for it (the cache's `ReaderPolicy`).

Invariant: one generation at a time per pair (`conversation/stream.py`). A stream holds the pair
from its first `next()` until it ends, is closed or is garbage collected; another thread waits
(`wait=True`, up to `timeout` s) or gets `BusyError` (`wait=False`). However a stream stops, the
tokens emitted are the answer and both caches stay consistent.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation import reader
from mlx_kvlingo.conversation.session import MODES, Session, templated  # noqa: F401  (for serve)
from mlx_kvlingo.conversation.stream import (
    AUTO_THRESHOLD,
    LABEL,
    BusyError,
    GenerationResponse,
    PairLock,
    final,
    open_stream,
    sampler_kwargs,
)
from mlx_kvlingo.conversation.stream import SessionError as ConversationError
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair

__all__ = ["AUTO_THRESHOLD", "MODES", "BusyError", "ConversationError", "Conversation",
           "GenerationResponse", "Pair", "generate", "load", "load_prompt_cache", "make_prompt_cache",
           "save_prompt_cache", "stream_generate"]  # fmt: skip

PromptCache = Session  # both models' caches and the conversation (conversation/session.py)
_LOCKS: weakref.WeakKeyDictionary[Session, PairLock] = weakref.WeakKeyDictionary()


class Pair:
    """What `load` returns: the small and large models, their translators, and the one lock."""

    def __init__(self, models: ModelPair, forward: Translator | None,
                 backward: Translator | None = None, link: Any = None) -> None:  # fmt: skip
        self.models = models  # internal: the loaded pair (source = small, target = large)
        self.forward = forward  # small -> large translator (None: switching re-reads)
        self.backward = backward  # large -> small translator (None: switching re-reads)
        self.link = link  # distributed: rank 0's link to the ranks holding the large model
        self.lock = PairLock()
        self.caches: weakref.WeakSet[Session] = weakref.WeakSet()
        self.load_s: float | None = None  # `load`: seconds, warm-up included
        self.warmup_s: float | None = None
        self.rates: str | None = None  # the last warm-up's read rates: "measured" | "cached"
        self.rates_note = ""  # the same, as the banners say it
        self._retention: dict[tuple, Any] = {}

    @property
    def names(self) -> dict[str, str]:
        return {"small": self.models.source.name, "large": self.models.target.name}

    @property
    def tokenizer(self) -> Any:
        return self.models.tokenizer

    @property
    def busy(self) -> bool:
        return self.lock.busy

    def warm_up(self, lengths: tuple[int, ...] = (16, 64), *, reuse: bool = True,
                **sampling: Any) -> float:  # fmt: skip
        """Pay the first turn's one-off costs now and give reader "auto" this pair's read
        rates (measured on a first start and kept in the cache folder, reused from it later:
        `rates`; `reuse=False` measures again). `sampling`: the settings real turns use (as
        `stream_generate` takes them). Seconds."""
        from mlx_kvlingo.conversation.warmup import start

        if self.link is not None:
            raise ConversationError("warm_up is not available with a pipelined large model")
        costs = start(self.models, self.forward, self.backward, lengths=lengths, reuse=reuse,
                      sample=lambda role: sampler_kwargs(self, LABEL[role], sampling, False))  # fmt: skip
        self.warmup_s = float(costs.warmup_s or 0.0)
        self.rates = costs.origin
        notes = {"measured": "rates measured", "cached": "rates reused from the cache"}
        self.rates_note = notes.get(costs.origin or "", "")
        return self.warmup_s

    def retention(self, policy: ReaderPolicy | None = None) -> Any:
        """What the forward translator keeps of the content by length under `policy`'s tail
        and recompute share (conversation/reader.py: this pair's measured counts pooled with
        those a demo translator ships); None where nothing is measured ("auto" weighs time)."""
        from mlx_kvlingo.models.demo.pair import shipped_retention

        policy = policy or ReaderPolicy()
        settings = (policy.large_reads_last, policy.recompute_share)
        if self.forward is not None and settings not in self._retention:
            draws = reader.load_retention(reader.retention_key(self.models, self.forward, policy))
            path = getattr(self.forward, "path", None)
            if path and (shipped := shipped_retention(path, *settings)):
                draws = {str(shipped.get("source")): reader.counts_of(shipped), **draws}
            pooled = reader.pooled(*draws.values())
            self._retention[settings] = reader.Retention.from_counts(pooled, "; ".join(draws))
        return self._retention.get(settings)

    def memory(self) -> dict[str, int]:
        """Bytes in use: MLX's counters (active, peak, cache), the weights, the translators and
        the KV caches of the prompt caches alive."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        caches = list(self.caches)
        maps = tree_flatten([t.parameters() for t in (self.forward, self.backward) if t])
        kv = sum(int(getattr(c, "nbytes", 0) or 0) for s in caches for r in ("source", "target")
                 for c in s.cache(r))  # fmt: skip
        return {"active": int(mx.get_active_memory()), "peak": int(mx.get_peak_memory()),
                "cache": int(mx.get_cache_memory()), "small": int(self.models.source.nbytes()),
                "large": int(self.models.target.nbytes()),
                "translators": sum(int(v.nbytes) for _, v in maps),
                "kv": kv, "conversations": len(caches)}  # fmt: skip

    def close(self) -> None:
        """Distributed: release the other ranks (they exit). Single process: nothing to do."""
        if self.link is not None:
            self.link.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(
    small: str | Path | None = None,
    large: str | Path | None = None,
    translator: str | Path | Translator | None = None,
    backward_translator: str | Path | Translator | None = None,
    *,
    pair: str | None = None,
    distributed: bool | None = None,
    wire: str = "auto",
    timeout: float | None = None,
    warmup: bool = True,
) -> Pair:
    """Load a pair and its translators: `small`/`large` hub ids or mlx-lm folders, or neither
    for a demo pair (`pair`: "dense", the default, or "moe"; its shipped translators unless
    named). `translator` maps small -> large, `backward_translator` large -> small: a file, a
    Hub id `org/name[@revision][:file]`, a demo file name or None (switching into that model then
    re-reads). Wrong files, pairs or names are ValueErrors (models/loading.py).
    `distributed`: pipeline the large model over an `mlx.launch` run's ranks (None: when so
    launched); ranks > 0 serve inside this call and exit (`wire`, `timeout`:
    mlx_kvlingo/distributed/README.md). `warmup`: run `Pair.warm_up()` before returning."""
    from mlx_kvlingo.distributed.pipeline import launched
    from mlx_kvlingo.models.loading import load_models_and_translators

    t0 = time.perf_counter()
    if distributed or (distributed is None and launched()):
        from mlx_kvlingo.distributed.session import load_runtime

        out = Pair(*load_runtime(small, large, translator, backward_translator, pair,
                                 wire=wire, timeout=timeout))  # fmt: skip
    else:
        out = Pair(*load_models_and_translators(small, large, translator, backward_translator,
                                                pair))  # fmt: skip
        if warmup:
            out.warm_up()
    out.load_s = time.perf_counter() - t0
    return out


def make_prompt_cache(pair: Pair, max_kv_size: int | None = None, *,
                      system_prompt: str | None = None, mode: str = "alternation",
                      policy: ReaderPolicy | None = None) -> PromptCache:  # fmt: skip
    """A new conversation over `pair`: both models' caches and the messages. `max_kv_size` caps
    its length in tokens; `mode` is how a model catches up on turns it did not see
    ("alternation", "naive", "reprefill"); `policy` who reads a turn (None: its defaults, no
    recompute for a pipelined large model)."""
    if policy is None:
        policy = ReaderPolicy(recompute_share=0.0) if pair.link else ReaderPolicy()
    cache = Session(pair.models, pair.forward, pair.backward, mode, system_prompt=system_prompt,
                    max_kv_size=max_kv_size, policy=policy, remote=pair.link,
                    retention=pair.retention(policy))  # fmt: skip
    pair.caches.add(cache)
    _LOCKS[cache] = pair.lock
    return cache


def save_prompt_cache(file_name: str | Path, cache: PromptCache) -> Path:
    """Write both caches and the conversation to one mlx-lm prompt cache file (a `.safetensors`
    suffix is added), once the pair is free; the path written."""
    return Path(_held(cache, lambda: cache.save(file_name)))


def load_prompt_cache(file_name: str | Path, pair: Pair, *, mode: str = "alternation",
                      max_kv_size: int | None = None) -> PromptCache:  # fmt: skip
    """A prompt cache saved by `save_prompt_cache` for this pair (its reader policy with it)."""
    cache = make_prompt_cache(pair, max_kv_size, mode=mode)
    _held(cache, lambda: cache.load(file_name))
    return cache


def stream_generate(pair: Pair, prompt: str | list[int] | None,
                    prompt_cache: PromptCache | None = None, **kwargs: Any
                    ) -> Iterator[GenerationResponse]:  # fmt: skip
    """Stream an answer to `prompt` (see the module docstring) from `model`, one response per
    token, as mlx-lm's `stream_generate`. Keywords:

    `model`: "large" (default; the small reads the turn for it), "small", or "auto" (the small
    answers; when its confidence, the mean token log-prob, is under `auto_threshold`, the large
    answers again: both answers stream, the small one's last response has `handoff.escalating`);
    `reader`: who reads this turn for the large model ("auto", "tokens", "small", "self";
    default: the cache's policy); `max_tokens` (256); `sampler`, `logits_processors`,
    `prompt_progress_callback(done, total)` as mlx-lm's, or the sampling settings `temp`,
    `top_p`, `top_k`, `min_p`, `repetition_penalty`, `repetition_context_size`, `seed`, each
    merged over the answering model's defaults (conversation/stream.py; `seed` plus the
    number of earlier answers seeds MLX: a new draw each turn, reproducible from the messages);
    `wait`, `timeout`: when another generation holds the pair."""
    cache = make_prompt_cache(pair) if prompt_cache is None else prompt_cache
    return open_stream(pair, cache, prompt, threading.Event(), dict(kwargs))


def generate(pair: Pair, prompt: str | list[int] | None, verbose: bool = False,
             **kwargs: Any) -> str:  # fmt: skip
    """The whole answer that stays in the conversation, as mlx-lm's `generate`; `verbose`
    prints it as it streams, then the status line."""
    last = None
    for last in stream_generate(pair, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(f"\n{last.status}")
    return last.handoff.text if last is not None and last.handoff else ""


class Conversation:
    """One conversation over a `Pair`, for apps: its prompt cache (`cache`), streams that any
    thread may `cancel()`, and every change made under the pair's lock (`wait`/`timeout` as in
    `stream_generate`). `Conversation(pair, max_kv_size, system_prompt=..., mode=...,
    policy=...)` as `make_prompt_cache`, or `Conversation(pair, prompt_cache=cache)`."""

    def __init__(self, pair: Pair, max_kv_size: int | None = None, *,
                 prompt_cache: PromptCache | None = None, **cache_kwargs: Any) -> None:  # fmt: skip
        self.pair = pair
        self.cache = prompt_cache or make_prompt_cache(pair, max_kv_size, **cache_kwargs)
        self._cancel = threading.Event()

    def send(self, prompt: str | list[int] | None = None, model: str | None = "large",
             **kwargs: Any) -> Iterator[GenerationResponse]:  # fmt: skip
        """`stream_generate` on this conversation (the same `prompt`, `model` and keywords);
        `escalate=True` answers the last user message again with the other model (or `model`):
        the last answer is dropped, the incoming model catches up and answers."""
        self._cancel.clear()
        kwargs["redo"] = kwargs.pop("escalate", False)
        return open_stream(self.pair, self.cache, prompt, self._cancel, {**kwargs, "model": model})

    def cancel(self) -> None:
        """Stop the running (or waiting) answer after its current token. Any thread."""
        self._cancel.set()
        self.cache.cancel()
        self.pair.lock.wake()

    @property
    def last(self) -> GenerationResponse | None:
        """The last answer's last response (its record and status), also of one stopped early."""
        st = self.cache.last_turn
        return None if st is None else final(self.pair, st)

    @property
    def messages(self) -> list[dict[str, str]]:
        return copy.deepcopy(self.cache.messages)

    @property
    def tokens(self) -> int:
        return len(self.cache.tokens)

    @property
    def mode(self) -> str:
        """How a model catches up on turns it did not see: alternation | naive | reprefill."""
        return str(self.cache.mode)

    @mode.setter
    def mode(self, mode: str) -> None:
        _held(self.cache, lambda: setattr(self.cache, "mode", mode))

    @property
    def policy(self) -> ReaderPolicy:
        """Who reads a turn for the large model (`ReaderPolicy`, its reader resolved); set a
        new one with `dataclasses.replace(conv.policy, reader="self")`."""
        return self.cache.policy  # type: ignore[no-any-return]

    @policy.setter
    def policy(self, policy: ReaderPolicy) -> None:
        def change() -> None:
            self.cache.policy, self.cache.retention = policy, self.pair.retention(policy)

        _held(self.cache, change)

    def add_messages(self, messages: list[dict[str, str]], *, wait: bool = True,
                     timeout: float | None = None) -> None:  # fmt: skip
        """Append earlier turns (role "user" / "assistant") unread: the next answer catches up."""
        for m in messages:
            if m.get("role") not in ("user", "assistant") or not isinstance(m.get("content"), str):
                raise ConversationError(f"each message needs role user or assistant and a "
                                        f"string content: {m!r}")  # fmt: skip

        def add() -> None:
            for m in messages:
                add_one = self.cache.add_user if m["role"] == "user" else self.cache.add_assistant
                add_one(m["content"])

        _held(self.cache, add, wait, timeout)

    def trim(self, max_tokens: int | None = None, *, wait: bool = True,
             timeout: float | None = None) -> int:  # fmt: skip
        """Drop the oldest turns until the conversation fits `max_tokens` (default: half of
        `max_kv_size`); the system prompt and the last message stay. Messages dropped."""
        return int(_held(self.cache, lambda: self.cache.trim(max_tokens), wait, timeout))

    def save(self, path: str | Path, *, wait: bool = True, timeout: float | None = None) -> Path:
        """`save_prompt_cache`, waiting for the pair as `wait`/`timeout` say."""
        return Path(_held(self.cache, lambda: save_prompt_cache(path, self.cache), wait, timeout))

    def load(self, path: str | Path, *, wait: bool = True, timeout: float | None = None) -> None:
        """Replace this conversation with one saved for the same pair."""
        _held(self.cache, lambda: self.cache.load(path), wait, timeout)

    def reset(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        _held(self.cache, self.cache.reset, wait, timeout)


def _held(cache: PromptCache, fn: Callable[[], Any], wait: bool = True,
          timeout: float | None = None) -> Any:  # fmt: skip
    """`fn()` under the lock of the pair `cache` was made for (one generation at a time)."""
    lock = _LOCKS[cache]
    lock.acquire(cache, wait=wait, timeout=timeout)
    try:
        return fn()
    finally:
        lock.release()
