"""The warm-up: this pair's read rates (reader.py) ready before the first turn. A start reuses
the rates and map readings stored for its key, else (`reuse=False` too) runs `warm_up` and
stores them; then `probe`: each model that reads for a turn reads `PROBE_READ` tokens over
`PROBE_AT` zero positions once (this start's attention term), replacing a stored read of that
shape.
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
from mlx_kvlingo.kv.recompute import sentence_ends, special_ids
from mlx_kvlingo.kv.translator import MapReading, measure, reserve_translation_memory

LENGTHS = (16, 64)
PRIME = 8
PROBE_AT, PROBE_READ = 2048, 32  # PROBE_AT: at most half a model's context
_TEXT = (
    "The committee met on a grey Tuesday to weigh the river project, its costs and its "
    "delays, and the engineers explained each figure twice before anyone would vote. "
)


def start(pair, forward, backward=None, *, lengths=LENGTHS, sample=None, reuse=True) -> ReadCosts:
    """The pair's costs (`costs_of`) ready, stored or measured; their `origin` ("cached",
    "measured") and `warmup_s` say which start ran and how long it took."""
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
        probe(pair, forward, costs)
    costs.origin = "measured" if stored is None else "cached"
    costs.warmup_s = time.perf_counter() - t0
    return costs


def warm_up(pair, forward, backward=None, *, lengths=LENGTHS, sample=None,
            costs: ReadCosts | None = None) -> ReadCosts:  # fmt: skip
    """Measure this pair's costs into `costs` (default the pair's): each translator measures how
    its maps read fastest and faults in a translation's memory, a scratch turn pays the one-off
    costs unmeasured, then per length the product's own turns are measured (the small reading
    for the large, the large reading itself, then the small answering). `sample(role)`: the
    generate keywords real turns use (sampler, logits processors), so they compile here too."""
    costs, t0 = costs_of(pair) if costs is None else costs, time.perf_counter()
    for translator, into in ((forward, pair.target), (backward, pair.source)):
        if translator is not None:
            measure(translator)
            reserve_translation_memory(into, translator)
    _scratch(pair, forward, backward, (PRIME,), sample, None)
    _scratch(pair, forward, backward, lengths, sample, costs)
    probe(pair, forward, costs)
    costs.warmup_s = time.perf_counter() - t0
    return costs


def _scratch(pair, forward, backward, lengths, sample, costs: ReadCosts | None) -> None:
    """Scratch conversations measured into `costs` (None: thrown away; its large read made
    `ready`, so no turn times the large model's read apart)."""
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


def probe(pair, forward, costs: ReadCosts) -> None:
    """The module docstring's `probe` (the small model only with a `forward` translator)."""
    sentence_ends(pair.tokenizer)  # scans of the vocabulary, once a process
    special_ids(pair.tokenizer)
    ids = pair.tokenizer.encode(_TEXT * 4)[:PROBE_READ]
    for loaded, cost in ((pair.target, costs.target_read), (pair.source, costs.source_read)):
        at = min(PROBE_AT, (loaded.context_length or 2 * PROBE_AT) // 2)
        if at >= PROBE_READ and (loaded is pair.target or forward is not None):
            cost.observe(PROBE_READ, reader.timed_read(loaded, ids, at), at, again=True)
