"""One generation at a time per pair: each request on its own thread, under the pair's one lock.

    handler --submit(job)--> request thread: pair lock (waits) -> run --job.events--> handler
                             accepted | token... | done | error

Invariant: all model work for a request runs while its thread holds the pair lock, so MLX is
never driven from two threads and held conversations change only under it. One request runs, at
most `queue_size` wait (`QueueFull`: 503). `Job.cancel()` ends a wait or stops after the current
token. Model `auto`: the small answer is buffered until kept (confidence >= `auto_threshold`, or
cut by a stop sequence), else the large one answers live; no client sees withdrawn text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from mlx_kvlingo.api import (
    AUTO_THRESHOLD,
    Conversation,
    ConversationError,
    GenerationResponse,
    Pair,
    templated,
)
from mlx_kvlingo.serve.pool import Pool
from mlx_kvlingo.serve.protocol import APIError, ChatRequest, Limits

log = logging.getLogger("mlx_kvlingo.serve")


@dataclass(frozen=True)
class ServeConfig:
    """How the server listens and what it accepts (the `kvlingo serve` options)."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port
    api_key: str | None = None  # when set: `Authorization: Bearer <key>` on every request
    max_body_bytes: int = 1 << 20  # request body limit (413 beyond it)
    limits: Limits = Limits()
    queue_size: int = 8  # requests waiting behind the running one; 503 beyond
    max_conversations: int = 8  # held conversations (LRU) for prefix reuse; 0: off
    auto_threshold: float = AUTO_THRESHOLD  # `auto`: the large re-answers below this mean log-prob
    request_timeout: float = 600.0  # seconds a request may wait and run in all
    read_timeout: float = 30.0  # seconds to receive a request (slow clients are dropped)


@dataclass
class Result:
    """What the client gets at the end of a job."""

    pieces: list[tuple[str, float]]  # the answer's text pieces and their log-probs
    finish_reason: str  # OpenAI's: length (the model's or the context's limit) | stop
    usage: dict[str, Any]
    extra: dict[str, Any]  # the `kvlingo` object: who answered, escalation, reuse


@dataclass(eq=False)  # a job is itself: hashable, by identity
class Job:
    request: ChatRequest
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    events: queue.Queue = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _conv: Conversation | None = None
    _wake: Any = None  # the pair lock's wake (a waiting job looks at its cancel event)

    def cancel(self) -> None:
        """Stop this job's generation after its current token (any thread)."""
        self.cancelled.set()
        conv = self._conv
        if conv is not None:
            conv.cancel()
        if self._wake is not None:
            self._wake()

    def put(self, kind: str, *payload: Any) -> None:
        self.events.put((kind, *payload))


class _StopScan:
    """Cut text at the first stop sequence; hold back a tail that may be one's beginning."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""  # everything the model said
        self.sent = 0  # characters released

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a piece; return the text now safe to release and whether a stop was hit."""
        self.text += piece
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        held = (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k]))
        end = max(self.sent, min(hits) if hits else len(self.text) - max(held, default=0))
        out, self.sent = self.text[self.sent : end], end
        return out, bool(hits)


class Worker:
    """Requests over one pair: `submit` jobs, `close` when done."""

    def __init__(self, pair: Pair, config: ServeConfig, conversation_kwargs: dict) -> None:
        self.pair, self.config, lim = pair, config, config.limits
        kwargs = {"max_kv_size": lim.max_prompt_tokens + lim.max_tokens, **conversation_kwargs}
        self.pool = Pool(pair, config.max_conversations, **kwargs)
        n = max(config.queue_size, 0) + 1  # running + waiting
        self._slots = threading.BoundedSemaphore(n)
        self._threads = ThreadPoolExecutor(n, thread_name_prefix="kvlingo-request")
        self._jobs: dict[Job, Future] = {}  # accepted, not finished
        self.running: Job | None = None  # the job holding the pair
        self._closing = False

    def submit(self, job: Job) -> None:
        if self._closing or not self._slots.acquire(blocking=False):
            busy = f"the server is busy: one request runs and {self.config.queue_size} wait"
            raise APIError(
                503, busy, type="server_error", code="queue_full", headers={"Retry-After": "1"}
            )
        job._wake = self.pair.lock.wake
        self._jobs[job] = self._threads.submit(self._job, job)

    @property
    def waiting(self) -> int:
        return max(len(self._jobs) - (self.running is not None), 0)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running job and the waiting ones (503), wait for them to end."""
        self._closing = True
        jobs = list(self._jobs.items())
        for job, _ in jobs:
            job.cancel()
        wait([f for _, f in jobs], timeout)
        self._threads.shutdown(wait=False)
        self.pool.clear()

    def _job(self, job: Job) -> None:
        try:
            if not self.pair.lock.acquire(job, job.cancelled):  # cancelled waiting
                job.put("error", APIError(503, "the server is shutting down", type="server_error")
                        if self._closing else APIError(499, "cancelled", code="cancelled"))  # fmt: skip
                return
            self.running = job
            try:
                self._run(job)
            except APIError as e:
                job.put("error", e)
            except ConversationError as e:  # e.g. the conversation outgrew max_kv_size
                job.put("error", APIError(400, str(e), code="conversation_error"))
            except Exception as e:  # never let one request take the server down
                log.exception("request failed")
                job.put("error", APIError(500, f"internal error: {e}", type="server_error"))
            finally:
                self.running = None
                self.pair.lock.release()
        finally:
            self._jobs.pop(job, None)
            self._slots.release()

    def _run(self, job: Job) -> None:
        req = job.request
        n_prompt = len(templated(self.pair.tokenizer, req.messages, True))
        if n_prompt > self.config.limits.max_prompt_tokens:
            raise APIError(400, f"the conversation is {n_prompt} tokens; this server takes at "
                                f"most {self.config.limits.max_prompt_tokens} (max_prompt_tokens)",
                           param="messages", code="context_length_exceeded")  # fmt: skip
        queued = time.monotonic() - job.submitted
        conv, history, held = self.pool.checkout(req.messages)
        job._conv = conv
        try:
            before = conv.cache.stats()
            if history:
                conv.add_messages(history)
            job.put("accepted")
            result = self._answer(job, conv, before, held)
        finally:
            job._conv = None
        self.pool.checkin(conv)  # only after a whole answer: a failed one is not reused
        result.extra["queued_s"] = queued
        job.put("done", result)

    def _answer(self, job: Job, conv: Conversation, before: dict, held: int) -> Result:
        req = job.request
        last = req.messages[-1]["content"]
        escalated = False
        if req.model == "auto":
            stream = conv.send(last, "auto", auto_threshold=self.config.auto_threshold, **req.send)
            try:
                out = small = self._pump(job, conv, stream, live=False, close=False)
                if small.last.handoff.escalating and not job.cancelled.is_set():
                    escalated = True
                    out = self._pump(job, conv, stream, live=True)
                else:
                    for piece, lp in small.pieces:  # kept: release the buffered answer
                        job.put("token", piece, lp)
            finally:
                stream.close()  # a no-op at its end; else keeps the small answer as cut
        else:
            out = self._pump(job, conv, conv.send(last, req.model, **req.send), live=True)
        after = conv.cache.stats()

        def grew(role: str, *keys: str) -> int:
            return sum(
                after["models"][role].get(k, 0) - before["models"][role].get(k, 0) for k in keys
            )

        roles = {"small": "source", "large": "target"}  # a model reads for itself or the other
        read = {m: grew(r, "prompt_tokens", "read_for_other_tokens") for m, r in roles.items()}
        translated = {m: grew(r, "translated_into") for m, r in roles.items()}
        prompt, model = conv.tokens - out.tokens, out.last.model
        cached = max(prompt - read[model] - translated[model], 0)
        # read_tokens: what each model read (prefilled) itself; translated_tokens: into its cache
        usage = {"prompt_tokens": prompt, "completion_tokens": out.tokens,
                 "total_tokens": prompt + out.tokens, "prompt_tokens_details": {"cached_tokens": cached},
                 "read_tokens": read, "translated_tokens": translated}  # fmt: skip
        # ttft_s: the answering model's, catch-up included, queueing not
        confidence = small.last.handoff.confidence if req.model == "auto" else None
        extra = {"answered_by": model, "escalated": escalated, "confidence": confidence,
                 "reused_messages": held, "ttft_s": out.last.handoff.ttft_s, "status": out.last.status}  # fmt: skip
        reason = "length" if out.reason in ("length", "context") else "stop"
        return Result(out.pieces, reason, usage, extra)

    def _pump(self, job: Job, conv: Conversation, stream: Iterator[GenerationResponse],
              live: bool, close: bool = True) -> _Pumped:  # fmt: skip
        """Run one answer (up to its last response); emit its text (live) or buffer it. A stop
        sequence ends it; the stream is closed then (which commits the tokens emitted so
        far), and at the end unless `close` is False (a cascade goes on). A cancelled job asks
        the conversation to stop after the current token."""
        scan = _StopScan(job.request.stop)
        out = _Pumped()
        hit = False

        def emit(piece: str, lp: float) -> None:
            out.pieces.append((piece, lp))
            if live:
                job.put("token", piece, lp)

        try:
            for r in stream:
                if r.token is not None:
                    out.tokens += 1
                    lp = float(r.logprobs[r.token].item())
                    piece, hit = scan.feed(r.text)
                    if piece:
                        emit(piece, lp)
                    if hit:
                        out.reason = "stop"
                        break
                if r.finish_reason is not None:  # the answer's last response
                    out.reason = r.finish_reason
                    break
                if job.cancelled.is_set():
                    conv.cancel()  # ends the stream after this token, with its last response
        finally:
            if close or hit:
                stream.close()  # a no-op after the last response; else commits what was emitted
        if not hit and (rest := scan.text[scan.sent :]):  # the tail held back
            emit(rest, 0.0)
        out.last = conv.last  # the answer's record and status line, also where a stop cut it
        return out


@dataclass
class _Pumped:
    tokens: int = 0
    reason: str = "cancelled"  # until its last response or a stop sequence says otherwise
    last: GenerationResponse | None = None
    pieces: list[tuple[str, float]] = field(default_factory=list)
