"""The public, stable API: load a model pair once, hold many conversations over it.

    from mlx_kvlingo import Runtime

    runtime = Runtime.load()                     # the demo pair, or load(source, target, translator)
    chat = runtime.new_conversation(system_prompt="Be brief.")
    for event in chat.send("Hello", model="small"):
        print(event.text if event.kind == "token" else "\\n" + event.status, end="")

Everything exported from `mlx_kvlingo` (see `mlx_kvlingo.__all__`) follows semantic
versioning; the rest of the package (`session`, `pair`, `translator`, ...) is internal and may
change in any release.

Threading. One `Runtime` runs ONE operation at a time: a generation, `save`, `load`, `reset`
on any of its conversations. Its models are shared, and MLX evaluation must not be
interleaved from several threads. By default a call that finds the pair busy waits for it
(`wait=True`, optionally up to `timeout` seconds); with `wait=False` it raises
`RuntimeBusyError` at once. A thread that holds the pair and asks again for a *different*
conversation gets `RuntimeBusyError` (waiting would deadlock); asking again for the *same*
conversation first closes the stream it left unfinished (keeping the tokens it emitted).
`Conversation.cancel()` may be called from any thread at any time. A stream holds the pair
from its first `next()` until it ends, is closed or is garbage collected: iterate it to the
end, `break` out of the loop, or call `.close()`.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.rates import Retention
from mlx_kvlingo.conversation.records import (
    AUTO_THRESHOLD,
    LABEL,
    ROLE,
    SessionBusyError,
    SessionError,
    TokenEvent,
    TurnStats,
    status_line,
)
from mlx_kvlingo.conversation.sampling import Sampling
from mlx_kvlingo.conversation.sampling import resolve as resolve_sampling
from mlx_kvlingo.conversation.session import MODES, Progress, Session
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair

# Inputs are plain strings (often from a UI or a config), checked at run time:
#: a model by role: "small" (alias "source") prefills cheaply, "large" ("target") is the one to
#: escalate to;
ModelName = str
#: how a model catches up on the turns it did not see: "alternation" (translate only the span
#: it lacks), "naive" (re-translate everything: the drifting baseline), "reprefill" (read it).
Mode = str
#: who reads a new user turn before the large model answers: "auto" (whichever is predicted
#: to start the answer sooner), "tokens" (the small reads the opening and long turns), "small"
#: or "self"
Reader = str
EventKind = Literal["token", "done"]
Label = Literal["small", "large"]
#: What `send` and `escalate` return: iterate it; `close()` it to stop early.
Stream = Generator["Event", None, None]

#: Every error a conversation raises for a request it cannot honour (nothing to answer, unknown
#: model or mode, context full: `ContextOverflowError`, bad session file: `SessionFileError`).
ConversationError = SessionError


class RuntimeBusyError(SessionBusyError):
    """The runtime's model pair is in use by another generation (see the module docstring)."""


@dataclass(frozen=True)
class Timings:
    """What one answer cost."""

    ttft_s: float | None  # from the request to the first token, switch included
    prompt_tokens: int  # tokens the answering model read itself
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    switch_tokens: int  # tokens this model lacked when it took the turn (0: no switch)
    translated_tokens: int  # of those, tokens it got by KV translation (the rest it re-read)
    translate_s: float
    peak_memory_gb: float
    #: reader "small": tokens the small model read for the large one before it answered, and
    #: how long that took (0 when the answering model read for itself)
    read_tokens: int = 0
    read_s: float = 0.0
    #: the small read for it: the large model's predicted TTFT reading every token it lacked
    #: itself (its prefill plus its first step, at the rates measured on this pair); else None
    alone_prefill_s: float | None = None
    #: the way of reading this turn that was not taken, its TTFT predicted from the rates
    #: measured on this pair (the large reading itself, or the small reading for it); None
    #: when not predictable (no forward translator, rates not measured yet)
    alternative_ttft_s: float | None = None


@dataclass(frozen=True)
class Event:
    """One item of a streamed answer.

    `kind == "token"`: `text` is the new piece of text, `token`/`logprob` the sampled token.
    `kind == "done"` (always last, once the pair is free again): `text` is the whole answer,
    `finish_reason` is stop | length | context | cancelled, `timings` and `status` (the
    one-line per-turn summary, as `kvlingo chat` prints it) describe the turn.
    """

    kind: EventKind
    text: str
    model: Label
    token: int | None = None
    logprob: float | None = None
    finish_reason: str | None = None
    timings: Timings | None = None
    status: str = ""
    confidence: float | None = None  # done: mean token log-prob (0 = certain)
    #: done of a `cascade`'s small answer: True when the large model answers again next
    escalating: bool = False


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes in use: MLX's allocator counters plus what the runtime itself holds."""

    active_bytes: int  # arrays alive now (mx.get_active_memory)
    peak_bytes: int  # highest active_bytes since start or the last reset (mx.get_peak_memory)
    cache_bytes: int  # freed buffers MLX keeps for reuse (mx.get_cache_memory)
    small_weights_bytes: int
    large_weights_bytes: int
    translator_bytes: int  # both directions
    kv_cache_bytes: int  # KV caches of all open conversations (allocated buffers)
    conversations: int

    @property
    def weights_bytes(self) -> int:
        return self.small_weights_bytes + self.large_weights_bytes

    def __str__(self) -> str:
        def gb(n: int) -> str:
            return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

        return (
            f"active {gb(self.active_bytes)} · peak {gb(self.peak_bytes)} · "
            f"cache {gb(self.cache_bytes)} · weights {gb(self.weights_bytes)} "
            f"(small {gb(self.small_weights_bytes)}, large {gb(self.large_weights_bytes)}) · "
            f"translators {gb(self.translator_bytes)} · KV {gb(self.kv_cache_bytes)} in "
            f"{self.conversations} conversation{'s' if self.conversations != 1 else ''}"
        )


def _role(model: str) -> str:
    try:
        return ROLE[model]
    except (KeyError, TypeError):
        raise ConversationError(
            f"unknown model {model!r}; use 'small' (source) or 'large' (target)"
        ) from None


def _nbytes(module: Translator) -> int:
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(module.parameters())  # list of (name, array)
    return int(sum(v.nbytes for _, v in leaves))


def _seed(seed: int | None, messages: list[dict[str, str]]) -> None:
    """The one seed rule: an answer is drawn with MLX seeded to `seed` plus the number of
    assistant messages before the user message it answers. Reproducible from the messages
    alone (a client resending a conversation, a restored file, a conversation held in a
    server's pool), the same for whichever model answers or re-answers (escalate, cascade),
    and a new draw each turn."""
    if seed is not None:
        import mlx.core as mx

        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        before = messages[: users[-1]] if users else messages
        mx.random.seed(seed + sum(1 for m in before if m["role"] == "assistant"))


class _Ticket:
    """Who holds the pair: a conversation and, for a stream, a weak reference to it."""

    __slots__ = ("conversation", "stream")

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.stream: weakref.ref[Stream] | None = None


class Runtime:
    """A loaded model pair with its translators; conversations share it, one turn at a time.

    Build it with `Runtime.load(...)` (paths or hub ids) or `Runtime(pair, forward, backward)`
    from already loaded internal objects.
    """

    def __init__(
        self,
        pair: ModelPair,
        forward: Translator | None,
        backward: Translator | None = None,
        link: Any = None,
    ) -> None:
        # internal objects (mlx_kvlingo.models.pair / .translator), exposed for advanced use only
        self.pair = pair
        self.forward = forward  # small -> large translator (None: switching re-prefills)
        self.backward = backward  # large -> small translator (None: switching re-prefills)
        self._link = link  # distributed: rank 0's link to the other ranks (pipelined.Link)
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._ticket: _Ticket | None = None
        self._conversations: weakref.WeakSet[Conversation] = weakref.WeakSet()
        self.load_s: float | None = None  # Runtime.load: seconds, warm-up included
        self.warmup_s: float | None = None  # the last warm_up()
        #: where the last warm_up() got this pair's read rates: "measured" (and stored in the
        #: cache folder), "cached" (reused from it: measured by an earlier start on this
        #: machine, pair and library versions); None before any warm-up
        self.rates: str | None = None
        self._retention: dict[tuple, Retention | None] = {}

    def warm_up(
        self,
        lengths: tuple[int, ...] = (16, 64),
        sample: Callable[[str], dict[str, Any]] | None = None,
        *,
        reuse: bool = True,
    ) -> float:
        """Pay the first turn's one-off costs now and give reader "auto" this pair's read rates.

        The first start on a machine measures them (a scratch conversation per length, read
        both ways; see conversation/rates.py) and stores them in the cache folder
        (`KVLINGO_CACHE`, default ~/.cache/mlx-kvlingo), keyed by the machine, the pair's files
        and the library versions; a later start with the same key reuses them and only runs
        each path once on a few tokens (`rates` says which happened). `reuse=False` measures
        again (and stores the new rates). `sample(role)`: the generate keyword arguments real
        turns will use (default: each model's default sampling). Returns seconds."""
        from mlx_kvlingo.conversation.warmup import start

        if self._link is not None:
            raise ConversationError("warm_up is not available with a pipelined large model")
        if sample is None:  # each model's default sampling, as `send` uses without settings

            def sample(role: str) -> dict[str, Any]:
                loaded = self.pair.source if role == "source" else self.pair.target
                cfg = resolve_sampling(loaded)
                return {"sampler": cfg.sampler(), "logits_processors": cfg.logits_processors()}

        costs = start(self.pair, self.forward, self.backward, lengths=lengths, sample=sample,
                      reuse=reuse)  # fmt: skip
        self.warmup_s = seconds = float(costs.warmup_s or 0.0)
        self.rates = costs.origin
        return seconds

    @classmethod
    def load(
        cls,
        source: str | Path | None = None,
        target: str | Path | None = None,
        translator: str | Path | Translator | None = None,
        backward_translator: str | Path | Translator | None = None,
        *,
        distributed: bool | None = None,
        wire: str = "auto",
        timeout: float | None = None,
        warmup: bool = True,
        pair: str | None = None,
    ) -> Runtime:
        """Load a pair and its translators.

        `source`/`target`: hub ids or local mlx-lm folders; both None loads a bundled demo
        pair, `pair` ("dense", the default, or "moe": the small model -> SmolLM2-135M's
        Qwen3-MoE upcycle), and `translator`/`backward_translator` may then name one of its
        shipped files (None: its defaults; no shipped backward file: None). `pair` with
        `source`/`target` is a ValueError. Resolution and loading:
        `mlx_kvlingo.models.loading.load_models_and_translators`.
        `translator` maps small -> large, `backward_translator` large -> small; either may be
        None, and switching into that model then re-reads the conversation itself. A
        translator is a file path or a Hugging Face Hub id `org/name[@revision][:file]`
        (fetched into the Hub cache; `HF_HUB_OFFLINE=1` reads only the cache; `HubError`, a
        ValueError, when it cannot be had). Translator
        files are checked against the pair (`TranslatorFileError`, a ValueError, when wrong);
        a pair whose tokenizers differ raises `TokenizerMismatchError` (a ValueError).

        `distributed`: pipeline the large model over the ranks of an `mlx.launch` run (None:
        when started by mlx.launch with more than one rank). Every rank runs the same script;
        on rank 0 this returns the runtime (it holds the small model and the last layers of
        the large one), on the other ranks it does not return: they serve rank 0's requests
        with their layers and exit when rank 0 closes the runtime (`close()`, or at exit).
        `wire`: what a switch sends each rank, "source" K/V (the rank translates) or
        "target" K/V; "auto" sends the fewer bytes. `timeout`: seconds a rank waits for the
        others (to connect, or within one step) before it gives up with an error (default
        120). See mlx_kvlingo/distributed/README.md.

        `warmup`: before returning, run `warm_up()` so that the first real turn pays no one-off
        costs (compiled kernels, lazy weights, first allocations) and reader "auto" has this
        pair's rates (measured on the first start on this machine, reused from the cache folder
        on later ones: `rates`); `load_s` says how long loading took, warm-up included. Single
        process only.
        """
        t0 = time.perf_counter()
        runtime = cls._load(source, target, translator, backward_translator, distributed, wire,
                            timeout, pair)  # fmt: skip
        if warmup and runtime._link is None:
            runtime.warm_up()
        runtime.load_s = time.perf_counter() - t0
        return runtime

    @classmethod
    def _load(
        cls,
        source: str | Path | None,
        target: str | Path | None,
        translator: str | Path | Translator | None,
        backward_translator: str | Path | Translator | None,
        distributed: bool | None,
        wire: str,
        timeout: float | None,
        demo_pair: str | None = None,
    ) -> Runtime:
        from mlx_kvlingo.distributed.pipeline import launched
        from mlx_kvlingo.models.loading import load_models_and_translators

        if distributed or (distributed is None and launched()):
            return cls._load_distributed(
                source, target, translator, backward_translator, wire, timeout, demo_pair
            )
        loaded = load_models_and_translators(
            source, target, translator, backward_translator, demo_pair
        )
        return cls(*loaded)

    @classmethod
    def _load_distributed(
        cls,
        source: str | Path | None,
        target: str | Path | None,
        translator: str | Path | Translator | None,
        backward_translator: str | Path | Translator | None,
        wire: str,
        timeout: float | None,
        demo_pair: str | None = None,
    ) -> Runtime:
        from mlx_kvlingo.distributed.session import load
        from mlx_kvlingo.models.demo import pair as demo
        from mlx_kvlingo.models.loading import demo_paths, resolve_translator_spec, which_demo

        if isinstance(translator, Translator):
            raise ValueError("a distributed runtime takes a translator file (every rank reads it)")
        demo_pair = which_demo(source, target, demo_pair)
        if demo_pair is not None:
            source, target = demo_paths(demo_pair, translator)
            small = demo.source_for(translator, demo_pair)
        elif translator is None:
            raise ValueError("a distributed runtime needs the small -> large translator")
        else:
            small = None
        path = resolve_translator_spec(translator, False, demo_pair, small)
        if not isinstance(backward_translator, Translator):
            backward_translator = resolve_translator_spec(
                backward_translator, True, demo_pair, small
            )
        # ranks > 0 do not return from load: they serve rank 0, then exit
        link, pair = load(source, target, path, wire=wire, timeout=timeout)
        backward = backward_translator
        if backward is not None and not isinstance(backward, Translator):
            from mlx_kvlingo.models.files import load_translator

            backward = load_translator(backward, pair.reversed())
        return cls(pair, link.sp.translator, backward, link)

    @property
    def pipelined(self) -> bool:
        """Whether the large model is pipelined over ranks (it cannot recompute)."""
        return self._link is not None

    @property
    def ranks(self) -> int:
        """How many ranks hold the large model (1: this process alone)."""
        return self._link.ranks if self._link is not None else 1

    @property
    def bytes_sent(self) -> int:
        """Bytes this process has sent to the other ranks so far (0 in a single process)."""
        return self._link.bytes_sent if self._link is not None else 0

    def close(self) -> None:
        """Distributed: release the other ranks (they exit). Single process: nothing to do."""
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conversations ---------------------------------------------------------------------

    @property
    def models(self) -> dict[str, str]:
        """{"small": name, "large": name}."""
        return {"small": self.pair.source.name, "large": self.pair.target.name}

    def new_conversation(
        self,
        system_prompt: str | None = None,
        mode: Mode = "alternation",
        max_kv_size: int | None = None,
        policy: ReaderPolicy | None = None,
    ) -> Conversation:
        """A fresh conversation (its own two KV caches) over this runtime's pair.

        `max_kv_size` caps the conversation's length in tokens (None: no cap). `policy`: who
        reads a new user turn before the large model answers and what it recomputes
        (`ReaderPolicy`, mlx_kvlingo/config.py; None: its defaults, with no recompute for a
        pipelined large model, which cannot).
        """
        if policy is None:
            policy = ReaderPolicy(recompute_share=0.0) if self.pipelined else ReaderPolicy()
        session = Session(
            self.pair,
            self.forward,
            self.backward,
            mode,
            system_prompt=system_prompt,
            max_kv_size=max_kv_size,
            policy=policy,
            remote=self._link,  # a pipelined large model: its cache lives on the ranks
            retention=self.retention(policy),
        )
        return Conversation(self, session)

    def retention(self, policy: ReaderPolicy | None = None) -> Retention | None:
        """What the forward translator keeps of the content read, by length, under `policy`'s
        tail and recompute share (conversation/rates.py): the counts of `kvlingo eval --task
        content` on this pair (kept in the cache folder) pooled with those a demo translator
        ships; None where no length is measured (reader "auto" then weighs time alone)."""
        from mlx_kvlingo.conversation import rates
        from mlx_kvlingo.models.demo.pair import shipped_retention

        policy = policy or ReaderPolicy()
        if self.forward is None:
            return None
        settings = (policy.large_reads_last, policy.recompute_share)
        if settings not in self._retention:
            draws = rates.load_retention(rates.retention_key(self.pair, self.forward, policy))
            path = getattr(self.forward, "path", None)
            if path and (shipped := shipped_retention(path, *settings)):
                draws = {str(shipped.get("source")): rates.counts_of(shipped), **draws}
            found = Retention.from_counts(rates.pooled(*draws.values()), "; ".join(draws))
            self._retention[settings] = found
        return self._retention[settings]

    def restore(
        self, path: str | Path, mode: Mode = "alternation", max_kv_size: int | None = None
    ) -> Conversation:  # the reader policy is restored from the file
        """A conversation restored from a file written by `Conversation.save` for this pair."""
        conv = self.new_conversation(mode=mode, max_kv_size=max_kv_size)
        conv.load(path)
        return conv

    # -- resources -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a generation (or save/load/reset) holds the pair."""
        return self._owner is not None

    def memory(self, reset_peak: bool = False) -> MemoryUsage:
        """Memory in use now; `reset_peak=True` restarts the peak counter afterwards."""
        import mlx.core as mx

        kv = 0
        convs = list(self._conversations)
        for conv in convs:
            for role in ("source", "target"):
                kv += sum(int(getattr(c, "nbytes", 0) or 0) for c in conv._session.cache(role))
        usage = MemoryUsage(
            active_bytes=int(mx.get_active_memory()),
            peak_bytes=int(mx.get_peak_memory()),
            cache_bytes=int(mx.get_cache_memory()),
            small_weights_bytes=int(self.pair.source.nbytes()),
            large_weights_bytes=int(self.pair.target.nbytes()),
            translator_bytes=sum(_nbytes(t) for t in (self.forward, self.backward) if t),
            kv_cache_bytes=kv,
            conversations=len(convs),
        )
        if reset_peak:
            mx.reset_peak_memory()
        return usage

    # -- the pair lock (internal) ----------------------------------------------------------

    def _acquire(self, ticket: _Ticket, wait: bool, timeout: float | None) -> bool:
        """Take the pair for `ticket`; False when its conversation was cancelled meanwhile."""
        me = threading.get_ident()
        deadline = None if timeout is None else time.monotonic() + timeout
        conv = ticket.conversation
        while True:
            stale: Stream | None = None
            with self._cond:
                if self._owner is None:
                    self._owner, self._ticket = me, ticket
                    return True
                held = self._ticket
                if self._owner == me:
                    gen = held.stream() if held and held.stream else None
                    running = gen is None or getattr(gen, "gi_running", False)
                    if held is None or held.conversation is not conv or running:
                        raise RuntimeBusyError(
                            "this thread is streaming another conversation of this runtime: "
                            "finish that stream or close() it first (one generation at a time)"
                        )
                    stale = gen  # this conversation's unfinished stream: end it, then go on
                elif not wait:
                    raise RuntimeBusyError(
                        "the model pair is busy with another generation; retry later, "
                        "or send(..., wait=True) to wait for it"
                    )
                elif conv._cancel.is_set():
                    return False
                else:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise RuntimeBusyError(
                            f"the model pair stayed busy for {timeout} s (another generation)"
                        )
                    self._cond.wait(left)
                    continue
            if stale is not None:
                stale.close()  # commits what it emitted and releases the pair

    def _release(self) -> None:
        with self._cond:
            self._owner, self._ticket = None, None
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class Conversation:
    """One conversation over a `Runtime`: its messages and one KV cache per model.

    Create it with `Runtime.new_conversation()` or `Runtime.restore(path)`.
    """

    def __init__(self, runtime: Runtime, session: Session) -> None:
        self.runtime = runtime
        self._session = session  # internal: mlx_kvlingo.conversation.session.Session
        self._cancel = threading.Event()
        self._last: Event | None = None
        runtime._conversations.add(self)

    # -- state -----------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat so far, as role/content dicts (a copy)."""
        return copy.deepcopy(self._session.messages)

    @property
    def system_prompt(self) -> str | None:
        return self._session.system_prompt

    @property
    def mode(self) -> str:
        return self._session.mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        if mode not in MODES:
            raise ConversationError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        self._locked(lambda: setattr(self._session, "mode", mode), True, None)

    @property
    def policy(self) -> ReaderPolicy:
        """Who reads a new user turn before the large model answers, and what the large one
        recomputes (`ReaderPolicy`; its reader resolved). Change it with
        `conv.policy = dataclasses.replace(conv.policy, reader="self")`."""
        return self._session.policy

    @policy.setter
    def policy(self, policy: ReaderPolicy) -> None:
        def change() -> None:
            self._session.policy = policy
            self._session.retention = self.runtime.retention(policy)

        self._locked(change, True, None)

    @property
    def retention(self) -> Retention | None:
        """What the small path keeps of a turn's content by length, which reader "auto" weighs
        for this policy (`Runtime.retention`; None: not measured)."""
        return self._session.retention

    @property
    def tokens(self) -> int:
        """Length of the conversation in tokens."""
        return len(self._session.tokens)

    @property
    def token_ids(self) -> list[int]:
        """The conversation as the models read it: its token ids (a copy)."""
        return list(self._session.tokens)

    @property
    def pending(self) -> bool:
        """True when the conversation ends with a user message that has no answer yet (one
        refused as too long, say: `trim`, then `answer`)."""
        return self._session.pending

    @property
    def last(self) -> Event | None:
        """The `done` event of the last answer (None before the first one), also of one whose
        stream was closed or interrupted before its done event (it ends "cancelled")."""
        return self._last

    def stats(self) -> dict[str, Any]:
        """Totals per model: turns, tokens generated, read, translated, switches."""
        return self._session.stats()

    # -- answering -------------------------------------------------------------------------

    def send(
        self,
        text: str,
        model: ModelName = "large",
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        max_tokens: int = 256,
        wait: bool = True,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Stream:
        """Add a user message and stream `model`'s answer: token events, then one done event.

        By default the large model answers and the small one reads (the conversation's
        `reader`): the small model reads the new turn, the large one catches up by KV
        translation and decodes. Stopping early (`cancel()` from any thread, `break`,
        `close()`) keeps the tokens emitted so far as the answer and leaves both caches
        consistent.

        `sampling`: a dict of the settings to change, e.g. `{"temp": 0}` (greedy) or
        `{"top_p": 0.8, "seed": 1}`, merged over the answering model's defaults (its
        `generation_config.json`, else `mlx_kvlingo.conversation.sampling.DEFAULTS`); a `Sampling`, used
        whole; None: the model's defaults. The fields are those of `Sampling` (`temp`,
        `top_p`, `top_k`, `min_p`, `repetition_penalty`, `repetition_context_size`, `seed`);
        another is a ConversationError. `seed`: MLX's generator is seeded with `seed` plus
        the number of assistant messages before this turn (the one seed rule of every
        answer: reproducible from the messages, a new draw each turn, the same for an
        escalation). `max_tokens`: the answer's length limit. `wait`/`timeout`: what to do
        when another conversation is generating. `progress(reader, done, total)`: called as
        the turn is read, every `READ_CHUNK` tokens (`Session.generate`), e.g. for a
        progress line on a long document.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        role = _role(model)
        sample, seed = self._sample_kwargs(role, sampling, max_tokens, progress)

        def start() -> Iterator[TokenEvent]:
            self._session.add_user(text)
            _seed(seed, self._session.messages)
            return self._session.generate(role, **sample)

        return self._open(start, LABEL[role], wait, timeout)

    def answer(
        self,
        model: ModelName = "large",
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        max_tokens: int = 256,
        wait: bool = True,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Stream:
        """Stream `model`'s answer to what the conversation holds unanswered (turns given to
        `add_messages` or `add_tokens`), adding no message: `send` without the text. The same
        reader policy, `sampling` and stopping rules as `send`."""
        role = _role(model)
        sample, seed = self._sample_kwargs(role, sampling, max_tokens, progress)

        def start() -> Iterator[TokenEvent]:
            _seed(seed, self._session.messages)
            return self._session.generate(role, **sample)

        return self._open(start, LABEL[role], wait, timeout)

    def escalate(
        self,
        model: ModelName | None = None,
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        max_tokens: int = 256,
        wait: bool = True,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Stream:
        """Answer the last user message again with the other model (or `model`).

        The last answer is dropped; the incoming model catches up and answers. Typical use:
        the small model answered with low `confidence`, escalate to the large one. `sampling`
        as in `send`, merged over the incoming model's defaults.
        """
        role = _role(model) if model is not None else None
        if role is not None:
            label = LABEL[role]
        else:
            last = self._session.last_turn
            label = "small" if last is not None and last.model == "target" else "large"
        sample, seed = self._sample_kwargs(ROLE[label], sampling, max_tokens, progress)

        def start() -> Iterator[TokenEvent]:
            _seed(seed, self._session.messages)
            return self._session.escalate(role, **sample)

        return self._open(start, label, wait, timeout)

    def cascade(
        self,
        text: str | None,
        threshold: float = AUTO_THRESHOLD,
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        max_tokens: int = 256,
        wait: bool = True,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Stream:
        """The small model answers; below `threshold` confidence the large one answers again.

        `text` is added as a user message (None: answer what the conversation holds
        unanswered, as `answer`). The small model's answer streams as `send` streams it; its
        done event has `escalating=True` when its `confidence` (mean token log-prob,
        `conversation.records.answer_confidence`) is below `threshold`, and the stream then
        goes on with `escalate("large")`: the large model's token events and done event. A
        stopped (cancelled) small answer, or one without tokens, is kept as it is.
        `sampling` (as in `send`, each answer merging it over its own model's defaults) and
        its `seed` (the seed rule of `send`) apply to both answers.
        """
        kw: dict[str, Any] = dict(
            sampling=sampling,
            max_tokens=max_tokens,
            wait=wait,
            timeout=timeout,
            progress=progress,
        )
        self._sample_kwargs("target", sampling, max_tokens)  # a bad setting fails now
        if text is None:
            small = self.answer("small", **kw)
        else:
            small = self.send(text, "small", **kw)
        return self._cascade(small, threshold, kw)

    def _cascade(self, small: Stream, threshold: float, kw: dict[str, Any]) -> Stream:
        done: Event | None = None
        try:
            for ev in small:
                if ev.kind == "done":
                    done = ev
                    break
                yield ev
        finally:
            small.close()
        if done is None:
            return
        unsure = done.confidence is not None and done.confidence < threshold
        escalating = unsure and done.finish_reason != "cancelled"
        yield replace(done, escalating=escalating)
        if escalating:
            yield from self.escalate("large", **kw)

    def add_messages(
        self, messages: list[dict[str, str]], *, wait: bool = True, timeout: float | None = None
    ) -> None:
        """Append earlier turns (role "user" / "assistant", alternating) without answering them.

        For history that comes from elsewhere (a client's message list, another app): nothing
        is read now; the next answer catches up on it (the small model reads it by default).
        """
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise ConversationError(f"each message needs role 'user' or 'assistant': {m!r}")
            if not isinstance(m.get("content"), str):
                raise ConversationError(f"each message needs a string 'content': {m!r}")

        def add() -> None:
            for m in messages:
                if m["role"] == "user":
                    self._session.add_user(m["content"])
                else:
                    self._session.add_assistant(m["content"])

        self._locked(add, wait, timeout)

    def add_tokens(
        self, tokens: list[int], *, wait: bool = True, timeout: float | None = None
    ) -> None:
        """Append token ids as they are (no chat template), for the next `answer` to read: a
        raw completion prompt rather than a chat turn."""
        ids = [int(t) for t in tokens]
        self._locked(lambda: self._session.add_tokens(ids), wait, timeout)

    def ask(self, text: str, model: ModelName = "large", **kwargs: Any) -> Event:
        """`send` without streaming: the done event (its `text` is the whole answer)."""
        done: Event | None = None
        for ev in self.send(text, model, **kwargs):
            done = ev
        assert done is not None and done.kind == "done"
        return done

    def cancel(self) -> None:
        """Stop the running (or waiting) generation after its current token. Any thread."""
        self._cancel.set()
        self._session.cancel()
        self.runtime._wake()

    def trim(
        self, max_tokens: int | None = None, *, wait: bool = True, timeout: float | None = None
    ) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens (default:
        half of `max_kv_size`); the system prompt and the last message stay. Both caches are
        cut to the prefix the shortened conversation shares with the old one, and the next
        answering model re-reads the rest. Returns the number of messages dropped
        (`ContextOverflowError`, a ConversationError, when the last message alone is over)."""
        return self._locked(lambda: self._session.trim(max_tokens), wait, timeout)

    # -- files and reset -------------------------------------------------------------------

    def save(self, path: str | Path, *, wait: bool = True, timeout: float | None = None) -> Path:
        """Write the conversation and both KV caches to one file (`.safetensors` is added)."""
        return self._locked(lambda: self._session.save(path), wait, timeout)

    def load(self, path: str | Path, *, wait: bool = True, timeout: float | None = None) -> None:
        """Replace this conversation with one saved by `save` for the same model pair."""
        self._locked(lambda: self._session.load(path), wait, timeout)
        self._last = None

    def reset(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches."""
        self._locked(self._session.reset, wait, timeout)
        self._last = None

    # -- internals -------------------------------------------------------------------------

    def _sample_kwargs(
        self,
        role: str,
        sampling: Sampling | Mapping[str, Any] | None,
        max_tokens: int,
        progress: Progress | None = None,
    ) -> tuple[dict[str, Any], int | None]:
        """`generate` keywords for `role`'s answer under `sampling` (sampling.resolve, the one
        merge), and the seed for `_seed`. With `progress`, each chunk of the turn read
        (`catchup.READ_CHUNK` tokens) is reported."""
        loaded = self.runtime.pair.source if role == "source" else self.runtime.pair.target
        try:
            cfg = resolve_sampling(loaded, sampling)
        except ValueError as e:
            raise ConversationError(str(e)) from None
        sample = {
            "max_tokens": max_tokens,
            "sampler": cfg.sampler(),
            "logits_processors": cfg.logits_processors(),
        }
        if progress is not None:
            sample["progress"] = progress
        return sample, cfg.seed

    def _locked(self, fn: Callable[[], Any], wait: bool, timeout: float | None) -> Any:
        ticket = _Ticket(self)
        self.runtime._acquire(ticket, wait, timeout)  # ignores cancel: only streams observe it
        try:
            return fn()
        finally:
            self.runtime._release()

    def _open(
        self,
        start: Callable[[], Iterator[TokenEvent]],
        label: Label,
        wait: bool,
        timeout: float | None,
    ) -> Stream:
        self._cancel.clear()
        ticket = _Ticket(self)
        stream = self._stream(ticket, start, label, wait, timeout)
        ticket.stream = weakref.ref(stream)
        return stream

    def _stream(
        self,
        ticket: _Ticket,
        start: Callable[[], Iterator[TokenEvent]],
        label: Label,
        wait: bool,
        timeout: float | None,
    ) -> Stream:
        if not self.runtime._acquire(ticket, wait, timeout):
            yield Event("done", "", label, finish_reason="cancelled", status="cancelled")
            return
        events: Iterator[TokenEvent] | None = None
        before = self._session.last_turn
        try:
            events = start()
            if self._cancel.is_set():  # cancel() landed before generate() cleared the flag
                self._session.cancel()
            for te in events:
                yield Event("token", te.text, LABEL[te.model], te.token, te.logprob)
            st = self._session.last_turn
        finally:
            if events is not None:
                close = getattr(events, "close", None)
                if close is not None:
                    close()  # commits what was emitted, trims the caches to match
            self.runtime._release()
            after = self._session.last_turn
            if events is not None and after is not None and after is not before:
                self._last = self._done(after)  # also when stopped early: `last` describes it
        done = self._done(st) if st is not None else Event("done", "", label, status="")
        self._last = done
        yield done

    def _done(self, st: TurnStats) -> Event:
        sw = st.switch
        timings = Timings(
            ttft_s=st.ttft_s,
            prompt_tokens=st.prompt_tokens,
            prompt_tps=st.prompt_tps,
            generation_tokens=st.generation_tokens,
            generation_tps=st.generation_tps,
            switch_tokens=sw.lacked if sw else 0,
            translated_tokens=sw.translated if sw else 0,
            translate_s=sw.seconds if sw and sw.translated else 0.0,
            peak_memory_gb=st.peak_memory_gb,
            read_tokens=st.read.tokens if st.read else 0,
            read_s=st.read.seconds if st.read else 0.0,
            alone_prefill_s=st.alone_prefill_s,
            alternative_ttft_s=st.alternative_ttft_s,
        )
        reason = "cancelled" if st.finish_reason == "interrupted" else st.finish_reason
        return Event(
            "done",
            st.text,
            LABEL[st.model],
            finish_reason=reason,
            timings=timings,
            status=status_line(st, {ROLE[k]: v for k, v in self.runtime.models.items()}),
            confidence=st.confidence,
        )
