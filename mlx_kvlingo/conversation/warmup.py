"""The warm-up: what the first turn of a new process pays once, paid before it, and this pair's
read rates, measured on the first start and reused from the cache folder on later ones.

`start` is what a start runs (`load`, `kvlingo chat`, `kvlingo serve`): when the cache
folder holds the rates for this machine, pair and library versions (`rates_cache.py`), it
takes them (and each translator's map reading), runs only `prime`, a first call of each
path on a few tokens, and `check_load`: a short read of the large model, which rescales the
stored rates where this start's machine is busier or quieter than theirs (or, far off, has them
measured anew), and each model's long read again, for this start's attention term; otherwise it
runs `warm_up` and stores what it measured.

`warm_up`: a short scratch conversation is run twice over the pair: the first run (its
shortest turn) pays the one-off costs (MLX compiling its kernels, lazy weights, first
allocations, the chat template, the sampler), unrecorded; the second measures the read costs
of `timing.py` at a couple of lengths, both ways of reading, so reader "auto" starts from this
pair's own rates.
Before both, each translator measures how its maps read the source fastest on this pair's
shapes and this backend (`kv.translator.measure`), so the turns run what they will run later,
and on the CPU translates one scratch span of `kv.translator.RESERVE_TOKENS`, so that the first
translation at each new length up to it does not fault fresh memory in.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation import rates_cache
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.timing import NAMES, ReadCosts, costs_of
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import capture_from_cache, needs_recording
from mlx_kvlingo.kv.capture import prefill as capture_prefill
from mlx_kvlingo.kv.recompute import sentence_ends, special_ids
from mlx_kvlingo.kv.translator import append_translation, reserve_translation_memory
from mlx_kvlingo.kv.translator import measure as measure_map_reading

import mlx.core as mx

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
        if forward is not None:  # its turns read no tail, so they recompute nothing
            prime_recompute(pair)
    ids = selfs.tokens
    costs.target_read.observe(*attention_probe(pair.target, ids))
    if forward is not None:  # without one the small model never reads for the large
        costs.source_read.observe(*attention_probe(pair.source, ids))
    costs.warmup_s = time.perf_counter() - t0
    if log:
        log(f"warm-up {costs.warmup_s:.1f} s")
    return costs


#: each model reads PROBE_READ tokens over PROBE_AT cached ones (at most half its context): the
#: attention term of its read costs, which turns of a few dozen tokens do not show
PROBE_AT, PROBE_READ = 2048, 64


def attention_probe(loaded, ids: list[int]) -> tuple[int, float, int]:
    """`loaded` reads PROBE_READ of `ids` (repeated) over a scratch cache of PROBE_AT zero
    positions (attention costs the same whatever the K/V hold), `_runs()` times; returns the
    last read as (tokens, seconds, at), what `Cost.observe` takes. (0, 0.0, 0), which it
    ignores, where the context is too short for the probe."""
    at = PROBE_AT if loaded.context_length is None else min(PROBE_AT, loaded.context_length // 2)
    if at < PROBE_READ:
        return 0, 0.0, 0
    g, probe = loaded.geometry, _repeat(ids, PROBE_READ)
    dtype = loaded.dtype
    for _ in range(_runs()):
        cache = new_cache(loaded)
        k = mx.zeros((1, g.kv_heads, at, g.head_dim), dtype=dtype)
        v = mx.zeros((1, g.kv_heads, at, g.value_dim), dtype=dtype)
        append_kv(cache, [k] * len(cache), [v] * len(cache))
        t0 = time.perf_counter()
        mx.eval(loaded.model(mx.array(probe)[None], cache=cache))
        seconds = time.perf_counter() - t0
    return PROBE_READ, seconds, at


def turn_read(loaded, ids: list[int], kwargs: dict) -> float:
    """Seconds for `loaded` to read `ids` from an empty cache up to its first token, as a
    turn's read is timed (all but the last token, then the last, sampled with `kwargs`), the
    last of `_runs()` reads."""
    for _ in range(_runs()):
        cache = new_cache(loaded)
        t0 = time.perf_counter()
        _read_turn(loaded, ids, cache, kwargs)
        seconds = time.perf_counter() - t0
    return seconds


def _runs() -> int:
    """How many times a timed read runs: twice on a GPU, where the first compiles kernels for
    the new shapes; once on the CPU, where the first read took what the second did (the dense
    demo pair's models over 2,048 cached positions: 0.86 and 0.45 s, three reads each)."""
    return 2 if mx.default_device() == mx.gpu else 1


def _repeat(ids: list[int], n: int) -> list[int]:
    return (ids * (n // max(len(ids), 1) + 1))[:n]


#: a reusing start's load check: the large model's read of LOAD_READ tokens, against the
#: stored rates; beyond LOAD_TOLERANCE times what they predict (or under its inverse), every
#: rate is scaled by the ratio
LOAD_READ, LOAD_TOLERANCE = 64, 1.2
#: ... and beyond REMEASURE times (or under its inverse) and REMEASURE_S seconds off, a start
#: measures them anew: rates stored while the machine was busy are seldom off by one factor (on
#: the dense demo pair, one such file's short reads took 0.9-1.2 s whatever their length, and
#: scaled by this start's 64-token read it predicted a 41-token turn at 0.58 of what it took);
#: a few milliseconds off are no reason to, however many times over
REMEASURE, REMEASURE_S = 2.0, 0.05


def check_load(pair, costs: ReadCosts, forward=None, sample=None) -> float | None:
    """A reusing start's own reads against the stored rates, two kinds:

    1. The load: the large model reads LOAD_READ tokens up to its first token (`turn_read`,
       sampled with `sample("target")`), which replaces the stored read of that length;
       where it takes more than LOAD_TOLERANCE times what `costs` predict for it (or less
       than its inverse), every other stored rate is scaled by the ratio first
       (`ReadCosts.scale`), and the ratio is returned (else 1.0). Rates stored while
       another job ran predicted a quiet start's 41-token turn at 2.2x what it took. Beyond
       `REMEASURE` times and `REMEASURE_S` seconds, nothing is changed and None is returned
       (`start` measures anew; step 2 is skipped).
    2. The attention term: each model's `attention_probe` (the large one's, and the small
       one's where a `forward` translator has it read for the large) replaces the stored
       one (`Cost.remeasure`), whatever the ratio: one long read stored at another hour
       would otherwise set every long turn's prediction. Scaling every rate by the probe's
       ratio instead (the stored probe slow, the short rates right) predicted a 133-token
       turn on the small path at 0.69-0.78 of what it took."""
    ids = _repeat(pair.tokenizer.encode(_text(pair.tokenizer, LOAD_READ)), LOAD_READ)
    seconds = turn_read(pair.target, ids, sample("target") if sample else {})
    predicted = costs.target_read.predict(LOAD_READ)
    factor = seconds / predicted if predicted else 1.0
    if not 1 / REMEASURE <= factor <= REMEASURE and abs(seconds - predicted) > REMEASURE_S:
        return None  # `start` measures anew
    if 1 / LOAD_TOLERANCE <= factor <= LOAD_TOLERANCE:
        factor = 1.0
    else:
        costs.scale(factor)
    costs.target_read.remeasure(LOAD_READ, seconds)
    costs.target_read.remeasure(*attention_probe(pair.target, ids))
    if forward is not None:
        costs.source_read.remeasure(*attention_probe(pair.source, ids))
    return factor


#: what the banners say of `ReadCosts.origin`
ORIGIN = {"measured": "rates measured", "cached": "rates reused from the cache"}


def rates_text(origin: str | None, factor: float = 1.0) -> str:
    """Where the rates came from, as the banners say it: `ORIGIN`, and the factor a reusing
    start scaled them by (`check_load`)."""
    text = ORIGIN.get(origin or "", "")
    return f"{text}, scaled x{factor:.2f} to this start's load" if factor != 1.0 else text


#: the tokens each model reads, and each translator translates, in `prime`
PRIME_TOKENS = 8


def prime(pair, forward, backward=None, *, tokens: int = PRIME_TOKENS, sample=None) -> None:
    """The first call of each path on a few tokens, so that the first real turn of this process
    pays no one-off cost (lazy weights, MLX loading its compiled kernels, first allocations, the
    chat template, the sampler, the K/V a translator keeps of the first token). On the first
    `tokens` tokens of a chat-templated message: each model reads them into a scratch cache up
    to its first token as mlx-lm reads a prompt (all but the last token, then the last, sampled
    with `sample(role)`'s sampler and logits processors); then, per translator, the hand-off:
    all but the last token captured from the other model's cache, translated and appended to a
    scratch cache, the last token read over them and sampled; and what the large model's
    recompute looks up (`prime_recompute`)."""
    # the first tokens of a message templated as a real turn is (or plain text): a translator
    # that keeps the model's own first token computes that token's K/V once
    # (`kv.translator.first_token_kv`)
    scratch = Session(pair, None, None)
    scratch.add_user(_text(pair.tokenizer, tokens))
    ids = (scratch.tokens * 2)[: max(tokens, 2)]
    caches = {}
    for role, loaded in (("target", pair.target), ("source", pair.source)):
        cache = caches[role] = new_cache(loaded)
        _read_turn(loaded, ids, cache, sample(role) if sample else {})
    for translator, role, other in ((forward, "target", "source"), (backward, "source", "target")):
        if translator is None:
            continue
        into, out = (pair.target, pair.source) if role == "target" else (pair.source, pair.target)
        cut = translator.config.key_cut
        if needs_recording(out, cut):  # pre-norm keys: recomputed, as the hand-off does
            span = capture_prefill(out, ids[:-1], new_cache(out), cut=cut)
        else:
            span = capture_from_cache(out, caches[other], 0, len(ids) - 1)
            span.tokens = tuple(ids[:-1])
        cache = new_cache(into)
        append_translation(into, translator, span, cache)
        _first_token(into, ids, cache, sample(role) if sample else {})
    if forward is not None:
        prime_recompute(pair)


def prime_recompute(pair) -> None:
    """What the large model's recompute looks up once per process, looked up before the first
    turn the small model reads: the tokenizer's sentence ends (a scan of its vocabulary) and
    special ids (`kv.recompute`). On the dense demo pair on a CPU the first 128-token turn's
    recompute took 0.73-0.76 s without it, 0.54 s with it, as later turns do; running the
    recompute itself here saved nothing more."""
    sentence_ends(pair.tokenizer)
    special_ids(pair.tokenizer)


def _read_turn(loaded, ids: list[int], cache: list, kwargs: dict) -> None:
    """The model reads `ids` into `cache` up to its first token, as mlx-lm reads a prompt: all
    but the last token, then the last (`_first_token`)."""
    loaded.model(mx.array(ids[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    _first_token(loaded, ids, cache, kwargs)


def _first_token(loaded, ids: list[int], cache: list, kwargs: dict) -> None:
    """The model reads the last of `ids` over `cache` and samples, as mlx-lm's generate does."""
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        logits = loaded.model(mx.array(ids[-1:])[None], cache=cache)[:, -1, :]
        for processor in kwargs.get("logits_processors") or ():
            logits = processor(mx.array(ids), logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampler = kwargs.get("sampler")
        mx.eval(sampler(logprobs) if sampler else mx.argmax(logprobs, axis=-1))


def start(
    pair, forward, backward=None, *, lengths=(16, 64), sample=None, reuse: bool = True,
    cache_dir=None, log=None,
) -> ReadCosts:  # fmt: skip
    """What a start runs. With the rates stored for this machine, pair and library versions
    (and `reuse`): take them into the pair's costs and the translators' map readings, then
    `prime` and `check_load` (origin "cached"), unless its short read was too far from what
    they predict (`REMEASURE`): then, as without stored rates,
    `warm_up` and store what it measured over them (origin "measured"; a cache folder that
    cannot be written is no error). Returns the pair's costs, `warmup_s` the seconds this
    took."""
    t0 = time.perf_counter()
    costs = costs_of(pair)
    key = rates_cache.key(pair, forward, backward, lengths)
    stored = rates_cache.load(key, cache_dir) if reuse else None
    translators = {"forward": forward, "backward": backward}
    if stored is not None:
        costs.load(stored.costs.to_dict())
        for direction, translator in translators.items():
            if translator is not None and direction in stored.readings:
                translator.reading = stored.readings[direction]
        prime(pair, forward, backward, sample=sample)
        factor = check_load(pair, costs, forward, sample)
        if factor is not None:
            costs.load_factor = factor
            costs.origin, costs.warmup_s = "cached", time.perf_counter() - t0
            if log:
                rates = rates_text(costs.origin, costs.load_factor)
                log(f"warm-up {costs.warmup_s:.1f} s ({rates})")
            return costs
        costs.load({name: [] for name in NAMES})  # too far off to scale: measured anew
    warm_up(pair, forward, backward, lengths=lengths, sample=sample, costs=costs)
    costs.origin, costs.load_factor = "measured", 1.0
    readings = {d: t.reading for d, t in translators.items() if t is not None}
    rates_cache.save(key, costs, readings, cache_dir)
    costs.warmup_s = time.perf_counter() - t0
    if log:
        log(f"warm-up {costs.warmup_s:.1f} s ({rates_text(costs.origin)})")
    return costs
