"""A conversation whose large model is pipelined over `mlx.launch` ranks: rank 0 leads.

Rank 0 runs everything a single process runs, with the small model and its own target layers.
Its target model is `_Mirrored`: each forward call is first announced to the other ranks, which
run it on their layers and their copy of the cache, so mlx-lm's pipeline meets on every rank;
only rank 0 samples. `place` puts a translated span on every rank; a switch back gathers the
span's target K/V on rank 0. The other ranks run `follow`, a loop over rank 0's commands.

A command is a small all_sum from rank 0, [op, cache id, cache offset, n, start, wire, first],
then one with its token ids (forward) or dropped cache ids (drop).
Rank 0 names each target cache it creates with an id; before a command, a follower trims its
copy to rank 0's offset (rank 0's cache only shrinks by trimming, which needs no message),
creates a cache on first use, and drops the ids rank 0 no longer holds.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from mlx_kvlingo.distributed.pipeline import (
    DEFAULT_TIMEOUT,
    WIRES,
    DistributedError,
    RankLostError,
    ShardedPair,
    _broadcast,
    _lost_as_error,
    deadline,
    init,
    load_sharded_pair,
    place,
    recv_kv,
)
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import SpanKV, capture_from_cache
from mlx_kvlingo.models.pair import ModelPair, vocab_fingerprint

import mlx.core as mx

FORWARD, PLACE, GATHER, DROP, STOP = range(1, 6)
_open: Link | None = None  # rank 0: the followers serve one runtime at a time
_ID = "_kvlingo_cache_id"


class Link:
    """Rank 0's end: sends commands to the other ranks and keeps the byte count."""

    def __init__(self, sp: ShardedPair) -> None:
        self.sp, self.ranks, self.owners = sp, sp.size, sp.owners  # owners: each rank's layers
        self.bytes_sent = 0  # translated spans placed on the other ranks
        self.bytes_received = 0  # target K/V gathered for switches back to the small model
        self.closed = False
        self.lost = False  # a rank was lost: nothing more can be asked of the others
        self._ids = itertools.count(1)
        self._dropped: list[int] = []
        atexit.register(self.close)

    def close(self) -> None:
        """Release the other ranks (their `load` then ends their process)."""
        global _open
        if not (self.closed or self.lost):
            self.closed = True
            with _uninterrupted():
                self._command(STOP)
        if _open is self:
            _open = None

    def _command(self, op, cache=None, n=0, start=0, wire=0, first=0, body=None) -> None:
        if self.lost or (self.closed and op != STOP):
            state = "lost a rank" if self.lost else "is closed"
            raise DistributedError(f"this distributed runtime {state}")
        from mlx_lm.generate import generation_stream

        # nothing collective may still be running when the next command goes out
        mx.synchronize(generation_stream)
        mx.synchronize()
        if self._dropped:
            ids, self._dropped = self._dropped, []
            self._send([DROP, 0, 0, len(ids), 0, 0, 0], mx.array(ids, dtype=mx.int32))
        cid, offset = (self._id(cache), min(c.offset for c in cache)) if cache else (0, 0)
        self._send([op, cid, offset, n, start, wire, first], body)

    def _send(self, header: list[int], body: mx.array | None) -> None:
        with self._watch():
            for x in (mx.array(header, dtype=mx.int32), body):
                if x is not None:
                    _broadcast(x, self.sp.group, self.sp.timeout, "sending a command")

    @contextmanager
    def _watch(self):
        try:
            yield
        except RankLostError:
            self.lost = True
            raise

    def _id(self, cache: list) -> int:
        """The id the other ranks know `cache` by (a new one for a new, empty cache)."""
        head = cache[0]
        cid = getattr(head, _ID, None)
        if cid is None:
            if head.offset:
                raise DistributedError(
                    "this operation is not available when the large model is pipelined: it "
                    "needs a target cache the other ranks do not have"
                )
            cid = next(self._ids)
            setattr(head, _ID, cid)
            weakref.finalize(head, self._dropped.append, cid)
        return cid

    def forward(self, inputs: mx.array, cache: list) -> None:
        """Announce a forward call of the target on `cache` (rank 0 then runs its own part)."""
        if inputs.ndim != 2 or inputs.shape[0] != 1:
            raise DistributedError("a pipelined target runs one sequence at a time")
        with self._watch(), _lost_as_error("waiting for the last step"):
            mx.eval(inputs)  # the previous step (and its collectives) ends before the next
        tokens = inputs.reshape(-1).astype(mx.int32)
        self._command(FORWARD, cache, n=tokens.size, body=tokens)

    def place(self, cache: list, span: SpanKV) -> None:
        """Append a translated source span to `cache` here and on every rank."""
        sp = self.sp
        wire = sp.choose_wire()
        first = span.tokens[0] if span.start == 0 and span.tokens else -1
        with _uninterrupted():
            self._command(PLACE, cache, span.length, span.start, WIRES.index(wire), first)
            with self._watch():
                keys, values, sent = place(sp, span, wire, span.length, span.start, first)
            append_kv(cache, keys, values)
        self.bytes_sent += sent

    def gather(self, cache: list, start: int, end: int) -> SpanKV:
        """The target K/V of [start, end) for every layer, RoPE-free, gathered on rank 0."""
        sp = self.sp
        parts = {0: capture_from_cache(sp.target, cache, start, end)}
        with _uninterrupted(), self._watch():
            self._command(GATHER, cache, end - start, start)
            with deadline(0, sp.timeout, f"gathering a {end - start}-token span"):
                for r in range(1, sp.size):
                    k, v = recv_kv(sp, r, sp.target.geometry, len(sp.owners[r]), end - start)
                    parts[r] = SpanKV(k, v, start)
                    self.bytes_received += k.nbytes + v.nbytes
        order = sorted(parts, key=lambda r: sp.owners[r].start)
        keys = mx.concatenate([parts[r].keys.astype(mx.float32) for r in order])
        values = mx.concatenate([parts[r].values.astype(mx.float32) for r in order])
        return SpanKV(keys, values, start)


class _Mirrored:
    """Rank 0's target model: each call is announced to the other ranks, then run here."""

    def __init__(self, inner, link: Link) -> None:
        self._inner = inner
        self._link = link

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, inputs, cache=None, **kwargs):
        if cache is None:
            raise DistributedError("a pipelined target runs with a cache")
        with _uninterrupted():
            self._link.forward(inputs, cache)
            with _last_stage_only():
                out = self._inner(inputs, cache=cache, **kwargs)
            mx.async_eval([(c.keys, c.values) for c in cache])  # the receive runs, whatever is read
        return out


@contextmanager
def _uninterrupted():
    """Ctrl-C waits until the other ranks are told and this rank's part is scheduled: an
    interruption in between would leave the ranks out of step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    old = signal.signal(signal.SIGINT, lambda *args: pending.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            raise KeyboardInterrupt


@contextmanager
def _last_stage_only():
    """mlx-lm's pipelined forward ends in an all_gather of the last stage's output (it samples
    on every rank); here only rank 0, the last stage, samples: the all_gather is left out on
    every rank while the forward is built."""
    real = mx.distributed.all_gather
    mx.distributed.all_gather = lambda x, *args, **kwargs: x
    try:
        yield
    finally:
        mx.distributed.all_gather = real


def follow(sp: ShardedPair) -> None:
    """Ranks > 0: run rank 0's commands on this rank's layers until it says stop. An error here
    ends this process with a message: rank 0 then sees the rank as lost, not waiting for it."""
    caches: dict[int, list] = {}
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0 (it stops a turn)
    try:
        while True:
            # no deadline: rank 0 may wait for its user as long as it likes
            head = _broadcast(mx.zeros((7,), mx.int32), sp.group, None).tolist()
            op, cid, offset, n, start, wire, first = head  # `Link._command`'s header
            if op == STOP:
                return
            if op == DROP:
                for i in _broadcast(mx.zeros((n,), mx.int32), sp.group, sp.timeout).tolist():
                    caches.pop(i, None)
                continue
            cache = caches.get(cid)
            if cache is None:
                cache = caches[cid] = new_cache(sp.target)
            for c in cache:
                if c.offset < offset:
                    raise DistributedError(
                        f"rank {sp.rank}'s cache holds {c.offset} tokens, rank 0's {offset}: out of step"
                    )
                c.trim(c.offset - offset)
            if op == FORWARD:
                tokens = _broadcast(mx.zeros((n,), mx.int32), sp.group, sp.timeout)
                with _lost_as_error("running a forward step"), _last_stage_only():
                    sp.target.model.model(tokens[None], cache=cache)  # sends to the next rank
                    mx.eval([(c.keys, c.values) for c in cache])
            elif op == PLACE:
                keys, values, _ = place(sp, None, WIRES[wire], n, start, first)
                append_kv(cache, keys, values)
            elif op == GATHER:
                span = capture_from_cache(sp.target, cache, start, start + n)
                with _lost_as_error("sending a span to rank 0"):
                    sent = [
                        mx.distributed.send(x.astype(mx.float32), 0, group=sp.group)
                        for x in (span.keys, span.values)
                    ]
                    mx.eval(sent)
            else:
                raise DistributedError(f"unknown command {op} from rank 0")
    except (RuntimeError, ValueError) as e:  # DistributedError included
        why = f"rank 0 is gone ({e})" if isinstance(e, RankLostError) else e
        sys.stderr.write(f"kvlingo: rank {sp.rank}: {why}\n")
        sys.stderr.flush()
        os._exit(1)  # MLX's ring may block on teardown once a peer is gone


def load_runtime(source, target, translator, backward, demo_pair: str | None, *, wire: str = "auto",
                 timeout=None) -> tuple[ModelPair, Any, Any, Link]:  # fmt: skip
    """Every rank: load a named pair or the demo pair, the large model pipelined over the
    `mlx.launch` ranks, the forward translator a file every rank reads. Rank 0 gets (pair,
    forward, backward, link), its large model its share mirrored to the others, with the whole
    model's geometry; the other ranks serve rank 0 until it closes the link, then `SystemExit(0)`."""
    from mlx_kvlingo.kv.translator import Translator
    from mlx_kvlingo.models.files import load_translator
    from mlx_kvlingo.models.loading import demo_folders, resolve_translator_spec

    global _open
    if _open is not None:
        raise DistributedError("close the open distributed runtime before loading another")
    if isinstance(translator, Translator):
        raise ValueError("a distributed runtime takes a translator file (every rank reads it)")
    source, target, demo_pair, small = demo_folders(source, target, translator, backward, demo_pair)
    if demo_pair is None and translator is None:
        raise ValueError("a distributed runtime needs the small -> large translator")
    names = (str(source), str(target))
    path = resolve_translator_spec(translator, False, demo_pair, small, names)
    if not isinstance(backward, Translator):
        backward = resolve_translator_spec(backward, True, demo_pair, small, names[::-1])
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    group = init(timeout)
    sp = load_sharded_pair(source, target, path, group, wire, timeout)
    if sp.rank != 0:
        follow(sp)
        sys.stdout.flush()
        raise SystemExit(0)
    link = _open = Link(sp)
    whole = replace(sp.target.geometry, layers=sum(map(len, sp.owners)))
    tgt = replace(sp.target, model=_Mirrored(sp.target.model, link), geometry=whole)
    pair = ModelPair(sp.source, tgt, tgt.tokenizer, vocab_fingerprint(tgt.tokenizer))
    if backward is not None and not isinstance(backward, Translator):
        backward = load_translator(backward, pair.reversed())
    return pair, sp.translator, backward, link
