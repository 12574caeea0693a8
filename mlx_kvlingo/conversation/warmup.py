"""The warm-up: what the first turn of a new process pays once, paid before it.

A short scratch conversation is run twice over the pair: the first run (its shortest turn)
pays the one-off costs (MLX compiling its kernels, lazy weights, first allocations, the chat
template, the sampler), unrecorded; the second measures the read costs of `timing.py` at a
couple of lengths, both ways of reading, so reader "auto" starts from this pair's own rates.
Before both, each translator measures how its maps read the source fastest on this pair's
shapes and this backend (`map_reading.measure`), so the turns run what they will run later,
and on the CPU translates one scratch span of `decode.RESERVE_TOKENS`, so that the first
translation at each new length up to it does not fault fresh memory in.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.timing import ReadCosts, costs_of
from mlx_kvlingo.kv.map_reading import measure as measure_map_reading
from mlx_kvlingo.kv.translate import reserve_translation_memory

_TEXT = (
    "The committee met on a grey Tuesday to weigh the river project, its costs and its "
    "delays, and the engineers explained each figure twice before anyone would vote. "
)


def _text(tokenizer, n: int) -> str:
    """Plain text of about n tokens."""
    words = _TEXT.split()
    k = max(1, round(n * len(words) / max(len(tokenizer.encode(_TEXT)), 1)))
    return " ".join((words * (k // len(words) + 1))[:k])


def warm_up(
    pair, forward, backward=None, *, lengths=(16, 64), answer_tokens: int = 2, sample=None,
    costs: ReadCosts | None = None, log=None,
) -> ReadCosts:  # fmt: skip
    """Run a short scratch conversation twice so that the first real turn pays nothing once
    (the first run, at the shortest length only), and measure this pair's costs on the second
    (into `costs`, default the pair's).

    Each run: for each length, a user turn of about that many tokens answered by the large
    model twice over, once with the small model reading (small read, forward translation, the
    large model's recompute and first step, then the small catching up on the answer by
    backward translation) and once with the large model reading it itself; then the small
    model answers where the large read everything (a long backward translation, the small's
    decode). `sample(model)` gives the generate keyword arguments a real turn will use
    (sampler, logits processors), so they compile here too.
    """
    costs = costs_of(pair) if costs is None else costs
    t0 = time.perf_counter()
    for translator, into in ((forward, pair.target), (backward, pair.source)):
        if translator is not None:
            measure_map_reading(translator)
            reserve_translation_memory(into, translator)
    # the first run (the shortest length) pays the one-off costs, unrecorded
    for record, todo in ((ReadCosts(), lengths[:1]), (costs, lengths)):
        plain = ReaderPolicy(large_reads_last=1)  # each rate alone: no tail read
        selfs = Session(pair, forward, backward, read_costs=record,
                        policy=replace(plain, reader="self"))  # fmt: skip
        both = [selfs]
        if forward is not None:  # without one there is nothing to translate into the large
            both.insert(0, Session(pair, forward, backward, read_costs=record,
                                   policy=replace(plain, reader="small")))  # fmt: skip
        for n in todo:
            text = _text(pair.tokenizer, n)
            for s in both:
                s.add_user(text)
                kwargs = sample("target") if sample else {}
                for _ in s.generate("target", max_tokens=answer_tokens, **kwargs):
                    pass
        # the small model answering once where the large read it all: it catches up on the
        # whole conversation (a long backward translation), then decodes
        selfs.add_user(_text(pair.tokenizer, lengths[0]))
        kwargs = sample("source") if sample else {}
        for _ in selfs.generate("source", max_tokens=answer_tokens, **kwargs):
            pass
    costs.warmup_s = time.perf_counter() - t0
    if log:
        log(f"warm-up {costs.warmup_s:.1f} s")
    return costs
