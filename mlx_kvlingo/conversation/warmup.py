"""The warm-up: a new process's one-off costs paid before its first turn, and this pair's read
rates (rates.py) ready for reader "auto".

`start` (`Runtime.load`, `kvlingo chat`, `kvlingo serve`) takes the rates and map readings
stored for this machine, pair and versions (`rates.rates_key`), then runs `_scratch` once,
unrecorded (MLX compiling kernels, lazy weights, first allocations, the chat template, the
sampler), then `probe`. With none stored (or `reuse=False`) it runs `warm_up` and stores it:
each translator measures how its maps read fastest (`kv.translator.measure`) and faults in a
translation's memory on the CPU; `_scratch` unrecorded, `_scratch` at each length measured,
`probe`. A scratch conversation runs the product's own turns: per length a user turn answered by
the large model with the small reading it and with the large reading it itself, then one
answered by the small model (catching up by backward translation); `CatchUp.observe` records.

`probe`: each model that reads for a turn reads `PROBE_READ` tokens over `PROBE_AT` zero
positions (attention costs the same whatever the K/V hold), once a start; the read replaces a
stored one: this start's attention term c, which short turns do not show and long ones follow.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation import rates
from mlx_kvlingo.conversation.rates import ReadCosts, costs_of
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.recompute import sentence_ends, special_ids
from mlx_kvlingo.kv.translator import measure, reserve_translation_memory

import mlx.core as mx

LENGTHS = (16, 64)  # the scratch turns, tokens
PROBE_AT, PROBE_READ = 2048, 32  # PROBE_AT: at most half a model's context
_TEXT = (
    "The committee met on a grey Tuesday to weigh the river project, its costs and its "
    "delays, and the engineers explained each figure twice before anyone would vote. "
)


def start(pair, forward, backward=None, *, lengths=LENGTHS, sample=None, reuse=True,
          cache_dir=None) -> ReadCosts:  # fmt: skip
    """The pair's costs (`costs_of`) ready, the one-off costs paid; their `origin` ("cached",
    "measured") and `warmup_s` say which start ran and how long it took."""
    t0, costs, maps = (
        time.perf_counter(),
        costs_of(pair),
        {"forward": forward, "backward": backward},
    )
    key = rates.rates_key(pair, forward, backward, lengths)
    stored = rates.load_rates(key, cache_dir) if reuse else None
    if stored is None:
        warm_up(pair, forward, backward, lengths=lengths, sample=sample, costs=costs)
        rates.save_rates(key, costs, {d: t.reading for d, t in maps.items() if t}, cache_dir)
    else:
        for name in rates.NAMES:
            getattr(costs, name).samples = getattr(stored[0], name).samples
        for d, reading in stored[1].items():
            if maps[d] is not None:
                maps[d].reading = reading
        _scratch(pair, forward, backward, lengths[:1], sample, None)
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
    _scratch(pair, forward, backward, lengths[:1], sample, None)
    _scratch(pair, forward, backward, lengths, sample, costs)
    probe(pair, forward, costs)
    costs.warmup_s = time.perf_counter() - t0
    return costs


def _scratch(pair, forward, backward, lengths, sample, costs: ReadCosts | None) -> None:
    """A scratch conversation (module docstring), measured into `costs` (None: unrecorded; the
    large model's reads then need no timing either)."""
    costs = ReadCosts.fixed(target_read=(0.0, 1.0)) if costs is None else costs
    plain = ReaderPolicy(large_reads_last=1, recompute_share=0.0)  # each rate alone
    sessions = [Session(pair, forward, backward, read_costs=costs, policy=replace(plain, reader=r))
                for r in ("small", "self")[forward is None :]]  # fmt: skip
    turns = [(n, s, "target") for n in lengths for s in sessions]
    for n, s, role in [*turns, (lengths[0], sessions[-1], "source")]:  # the small answers last
        words = _TEXT.split()
        k = max(1, round(n * len(words) / len(pair.tokenizer.encode(_TEXT))))
        s.add_user(" ".join((words * (k // len(words) + 1))[:k]))
        for _ in s.generate(role, max_tokens=2, **(sample(role) if sample else {})):
            pass
    sentence_ends(pair.tokenizer)  # what the large model's recompute looks up once a process
    special_ids(pair.tokenizer)


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
