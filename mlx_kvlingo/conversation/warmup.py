"""The warm-up: a new process's one-off costs paid before its first turn, this pair's read rates
(reader.py) ready for reader "auto".

    reusing start     the rates and map readings stored for this key, the recompute's lookups,
                      `probe`
    measuring start   (none stored, or `reuse=False`) `warm_up`: each translator measures how
                      its maps read fastest and faults in a translation's memory, a scratch
                      turn, one scratch conversation at each of `lengths` measured, the
                      recompute's lookups, `probe`; then stored

A scratch conversation runs the product's own turns: per length a turn the small model reads
for the large one and one the large reads itself, then one the small answers; the first pays
what a process pays once (kernels compiled, weights faulted in, the template, the sampler), so
that none of it is measured. A reusing start measures nothing but its probes and runs no
scratch turn: its first turn pays those costs itself (on the CPU a first turn takes what a
later one does, READER_TIMING.md). `probe`: each model that reads for a turn reads `PROBE_READ`
tokens over `PROBE_AT` zero positions once (attention costs the same whatever the K/V hold),
replacing a stored read of that shape: this start's attention term, which long turns follow.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import replace

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation import reader
from mlx_kvlingo.conversation.reader import Cost, ReadCosts, costs_of
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.recompute import sentence_ends, special_ids
from mlx_kvlingo.kv.translator import MapReading, measure, reserve_translation_memory

import mlx.core as mx

LENGTHS = (16, 64)  # the measured scratch turns, tokens
PRIME = 8  # the scratch turn that pays the one-off costs, tokens (its answers: one token)
PROBE_AT, PROBE_READ = 2048, 32  # PROBE_AT: at most half a model's context
_TEXT = (
    "The committee met on a grey Tuesday to weigh the river project, its costs and its "
    "delays, and the engineers explained each figure twice before anyone would vote. "
)


def start(pair, forward, backward=None, *, lengths=LENGTHS, sample=None, reuse=True) -> ReadCosts:
    """The pair's costs (`costs_of`) ready, stored or measured (module docstring); their
    `origin` ("cached", "measured") and `warmup_s` say which start ran and how long it took."""
    t0, costs = time.perf_counter(), costs_of(pair)
    maps = {"forward": forward, "backward": backward}
    key = reader.rates_key(pair, forward, backward, lengths)
    data = reader.read(reader.RATES, key) if reuse else {}
    try:
        stored = ReadCosts.from_dict(data["costs"])
        readings = {d: MapReading.from_dict(data["map_reading"][d]) for d, t in maps.items() if t}
    except (KeyError, TypeError, ValueError):  # none stored, or not well formed
        stored = None
    if stored is None:
        warm_up(pair, forward, backward, lengths=lengths, sample=sample, costs=costs)
        with contextlib.suppress(OSError):  # an unwritable cache folder: measured every start
            chosen = {d: t.reading.to_dict() for d, t in maps.items() if t}
            reader.write(reader.RATES, key, costs=costs.to_dict(), map_reading=chosen)
    else:
        for name in reader.NAMES:
            getattr(costs, name).samples = getattr(stored, name).samples
        for d, reading in readings.items():
            maps[d].reading = reading
        prime_lookups(pair.tokenizer)
        probe(pair, forward, costs)
    costs.origin = "measured" if stored is None else "cached"
    costs.warmup_s = time.perf_counter() - t0
    return costs


def warm_up(pair, forward, backward=None, *, lengths=LENGTHS, sample=None,
            costs: ReadCosts | None = None) -> ReadCosts:  # fmt: skip
    """Measure this pair's costs into `costs` (default the pair's). `sample(role)`: the generate
    keyword arguments real turns use (sampler, logits processors), so they compile here too."""
    costs, t0 = costs_of(pair) if costs is None else costs, time.perf_counter()
    for translator, into in ((forward, pair.target), (backward, pair.source)):
        if translator is not None:
            measure(translator)
            reserve_translation_memory(into, translator)
    _scratch(pair, forward, backward, (PRIME,), sample, None)
    _scratch(pair, forward, backward, lengths, sample, costs)
    prime_lookups(pair.tokenizer)
    probe(pair, forward, costs)
    costs.warmup_s = time.perf_counter() - t0
    return costs


def _scratch(pair, forward, backward, lengths, sample, costs: ReadCosts | None) -> None:
    """A scratch conversation (module docstring), measured into `costs` (None: thrown away;
    its large read made `ready`, so no turn times the large model's read apart)."""
    unrecorded = costs is None
    if unrecorded:
        costs = ReadCosts(target_read=Cost(deque([(1, 1.0, 0), (2, 2.0, 0)])))
    plain = ReaderPolicy(large_reads_last=1, recompute_share=0.0)  # each rate alone
    sessions = [Session(pair, forward, backward, read_costs=costs, policy=replace(plain, reader=r))
                for r in ("small", "self")[forward is None :]]  # fmt: skip
    turns = [(n, s, "target") for n in lengths for s in sessions]
    for n, s, role in [*turns, (lengths[0], sessions[-1], "source")]:  # the small answers last
        words = _TEXT.split()
        k = max(1, round(n * len(words) / len(pair.tokenizer.encode(_TEXT))))
        s.add_user(" ".join((words * (k // len(words) + 1))[:k]))
        kwargs = sample(role) if sample else {}
        for _ in s.generate(role, max_tokens=1 if unrecorded else 2, **kwargs):
            pass


def prime_lookups(tokenizer) -> None:
    """What the large model's recompute looks up once a process (a scan of the vocabulary),
    so that the first turn the small model reads neither waits for it nor measures it."""
    sentence_ends(tokenizer)
    special_ids(tokenizer)


def probe(pair, forward, costs: ReadCosts) -> None:
    """Each model that reads for a turn (the small one only with a `forward` translator) reads
    `PROBE_READ` tokens over `PROBE_AT` cached, once; it replaces a read of that shape."""
    ids = mx.array(pair.tokenizer.encode(_TEXT * 4)[:PROBE_READ])[None]
    for loaded, cost in ((pair.target, costs.target_read), (pair.source, costs.source_read)):
        at = min(PROBE_AT, (loaded.context_length or 2 * PROBE_AT) // 2)
        if at < PROBE_READ or (loaded is pair.source and forward is None):
            continue
        g, cache = loaded.geometry, new_cache(loaded)
        k = mx.zeros((1, g.kv_heads, at, g.head_dim), dtype=loaded.dtype)
        v = mx.zeros((1, g.kv_heads, at, g.value_dim), dtype=loaded.dtype)
        append_kv(cache, [k] * len(cache), [v] * len(cache))
        mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        mx.eval(loaded.model(ids, cache=cache))
        cost.observe(PROBE_READ, time.perf_counter() - t0, at, again=True)


def rates_text(origin: str | None) -> str:
    """Where the rates came from, as the banners say it."""
    return {"measured": "rates measured", "cached": "rates reused from the cache"}.get(origin, "")
