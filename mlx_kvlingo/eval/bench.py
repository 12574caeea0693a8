"""Time to first token when the conversation switches models: translate the KV cache, or
re-prefill the prompt? Measured on this machine, for one pair, with nothing left out.

For a prompt of n tokens the two ways to get the target's first token are:

    re-prefill   target prefill of n-1 tokens, then one step on the last   = target TTFT  R
    switch       translate the source's K/V of n-1 tokens (X_tr), then the
                 target's step on the last token (X_step)                   = switch TTFT  X

The switch needs the source to have prefilled those n-1 tokens (P). The paper's speed-up
R / X leaves P out, which is right when the source had to read the prompt anyway (a cascade
that escalates) and wrong otherwise; both figures are reported, and the expected TTFT per
request against the escalation rate r for four policies (see `policy_lines`).

Every trial round runs both paths at every length, in an order that alternates by round, so
drift and noise from other processes hit both sides; warm-up rounds (every length, every
phase, so every weight and kernel has been touched and no measured trial is the first to grow
the heap to a length) are discarded. Peak memory is MLX's
allocator peak during the phase, loaded weights included.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.timing import ReadCosts
from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.report import md_row, md_table
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import capture_from_cache, needs_recording, prefill
from mlx_kvlingo.kv.map_reading import measure as measure_map_reading
from mlx_kvlingo.kv.translate import reserve_translation_memory
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import LoadedModel, ModelPair, describe_model

import mlx.core as mx
import numpy as np

SCHEMA = "mlx-kvlingo/bench"
SCHEMA_VERSION = 1
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size

#: phase key -> (label, tokens it processes for a prompt of n tokens)
PHASES: dict[str, tuple[str, Callable[[int], int]]] = {
    "source_prefill": ("source prefill + capture", lambda n: n - 1),
    "source_step": ("source first token", lambda n: 1),
    "target_prefill": ("target prefill (n-1)", lambda n: n - 1),
    "target_ttft": ("target re-prefill TTFT", lambda n: n),
    "target_step_reprefill": ("target first step after its prefill", lambda n: 1),
    "translate": ("translation", lambda n: n - 1),
    "target_step": ("target first step after translation", lambda n: 1),
    "switch_ttft": ("switch TTFT (translation + step)", lambda n: n),
    "translate_map": ("translator matmuls alone", lambda n: n - 1),
    "translate_steps": ("target-side steps alone (k_norm, RoPE, cast)", lambda n: n - 1),
    "cache_append": ("cache writes alone", lambda n: n - 1),
    "gemm": ("plain GEMM, same shapes", lambda n: n - 1),
}

#: The issue's performance targets, checked (not asserted) on every run.
TARGETS = {
    "translation_vs_step_at_64": 0.10,
    "gemm_efficiency": 0.70,
    "switch_speedup_at_64": 9.6,
    "linearity_r2": 0.99,
}


# -- formulas ------------------------------------------------------------------------------


def switch_speedup(target_ttft: float, switch_ttft: float) -> float:
    """The paper's figure: R / X, re-prefill TTFT over switch TTFT (source prefill not counted)."""
    return target_ttft / switch_ttft


def end_to_end_speedup(target_ttft: float, source_prefill: float, switch_ttft: float) -> float:
    """R / (P + X): the switch with the source's own prefill counted, against re-prefill."""
    return target_ttft / (source_prefill + switch_ttft)


def always_large(r, *, target_ttft: float):
    """Every request goes to the large model: E[TTFT] = R, whatever the escalation rate r."""
    return target_ttft + 0.0 * np.asarray(r, dtype=float)


def route_first(r, *, source_ttft: float, target_ttft: float):
    """A router picks one model before generation (a fraction r goes large; its cost ignored):
    E[TTFT] = (1 - r) S + r R. Translation cannot help: the source never read the prompt."""
    r = np.asarray(r, dtype=float)
    return (1 - r) * source_ttft + r * target_ttft


def cascade_reprefill(r, *, source_ttft: float, source_prefill: float, target_ttft: float):
    """The small model reads every prompt; a fraction r escalates after its prefill and the
    large model re-prefills: E[TTFT] = (1 - r) S + r (P + R)."""
    r = np.asarray(r, dtype=float)
    return (1 - r) * source_ttft + r * (source_prefill + target_ttft)


def cascade_translate(r, *, source_ttft: float, source_prefill: float, switch_ttft: float):
    """As `cascade_reprefill`, but escalation translates the source's cache:
    E[TTFT] = (1 - r) S + r (P + X)."""
    r = np.asarray(r, dtype=float)
    return (1 - r) * source_ttft + r * (source_prefill + switch_ttft)


def ahead_switch_ttft(
    *, translate: float, target_step: float, source_step: float, answer_tokens: int, share: float
) -> float:
    """The switch TTFT with translate-ahead: while the small model decoded its answer of
    `answer_tokens` tokens (`source_step` each), a `share` of that time translated the span;
    the escalation pays what is left plus one target step:
    X_ahead = target_step + max(0, translate - share * answer_tokens * source_step)."""
    return target_step + max(0.0, translate - share * answer_tokens * source_step)


def cascade_ahead(r, *, source_ttft: float, source_prefill: float, ahead_ttft: float):
    """As `cascade_translate`, with the span translated ahead (see `ahead_switch_ttft`):
    E[TTFT] = (1 - r) S + r (P + X_ahead). The small model's answer is slowed by at most the
    share; its TTFT is not (translation starts after its first token)."""
    r = np.asarray(r, dtype=float)
    return (1 - r) * source_ttft + r * (source_prefill + ahead_ttft)


def policy_lines(
    *,
    source_ttft: float,
    source_prefill: float,
    target_ttft: float,
    switch_ttft: float,
    ahead_ttft: float | None = None,
) -> dict[str, tuple[float, float]]:
    """Each policy's E[TTFT](r) = intercept + slope * r, as (intercept, slope)."""
    S, P, R, X = source_ttft, source_prefill, target_ttft, switch_ttft
    lines = {
        "always_large": (R, 0.0),
        "route_first": (S, R - S),
        "cascade_reprefill": (S, P + R - S),
        "cascade_translate": (S, P + X - S),
    }
    if ahead_ttft is not None:
        lines["cascade_ahead"] = (S, P + ahead_ttft - S)
    return lines


def break_even(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """Escalation rate r in [0, 1] where lines a and b (intercept, slope) cost the same:
    r* = (b0 - a0) / (a1 - b1). None when they do not cross inside [0, 1] (or are parallel)."""
    if a[1] == b[1]:
        return None
    r = (b[0] - a[0]) / (a[1] - b[1])
    return r if 0.0 <= r <= 1.0 else None


def cheaper_up_to(line: tuple[float, float], reference: tuple[float, float]) -> float:
    """The escalation rate up to which `line` costs no more than `reference`: their break-even
    point, 1.0 when `line` is cheaper at every rate in [0, 1], 0.0 when it is not cheaper at
    r = 0 (never, or only above the break-even, which needs S > R)."""
    r = break_even(line, reference)
    if r is not None:
        return r if line[1] > reference[1] else 0.0
    return 1.0 if line[0] + 0.5 * line[1] <= reference[0] + 0.5 * reference[1] else 0.0


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict:
    """Least-squares y = a + b x with R^2 (R^2 = 1 for fewer than 3 points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2:
        return {"intercept": float(y[0]) if len(y) else 0.0, "slope": 0.0, "r2": 1.0}
    b, a = np.polyfit(x, y, 1)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - (a + b * x)) ** 2).sum()) / ss if ss > 0 else 1.0
    return {"intercept": float(a), "slope": float(b), "r2": r2}


def summarize(values: Sequence[float]) -> dict:
    v = np.asarray(values, float)
    return {
        "n": int(v.size),
        "median": float(np.median(v)),
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
    }


# -- the machine -----------------------------------------------------------------------------


def available_memory() -> int:
    """Bytes that can still be allocated (MemAvailable on Linux; Metal's working set else)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if mx.metal.is_available():
        info = mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size", 0)) - mx.get_active_memory()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - mx.get_active_memory()


def pair_info(pair: ModelPair, translator: Translator, **extra) -> dict:
    c = translator.config
    return {
        "source": describe_model(pair.source),
        "target": describe_model(pair.target),
        "tokenizer": pair.tokenizer_fingerprint,
        "translator": {
            "variant": c.variant,
            "nu": [c.nu_k, c.nu_v],
            "key_cut": c.key_cut,
            "bias": c.bias,
            "dtype": str(map_weights(translator)[0].dtype).replace("mlx.core.", ""),
            "parameters": sum(int(w.size) for w in map_weights(translator)),
            "provenance": c.metadata.get("provenance"),
        },
        **extra,
    }


# -- memory estimate -------------------------------------------------------------------------


def _activation_bytes(m: LoadedModel, n: int) -> int:
    cfg, c = m.config, min(n, PREFILL_STEP)
    h = cfg["hidden_size"]
    scores = 3 * cfg["num_attention_heads"] * c * n * 4  # scores, mask, softmax (float32)
    if cfg.get("num_experts"):
        k = cfg["num_experts_per_tok"]
        ffn = c * k * (3 * cfg["moe_intermediate_size"] + 3 * h) * 4
    else:
        ffn = 3 * c * cfg["intermediate_size"] * 4
    return scores + ffn + 8 * c * h * 4


def working_bytes(pair: ModelPair, translator: Translator, n: int) -> int:
    """Rough extra memory (beyond the loaded weights) the largest phase at prompt length n
    needs: source prefill (its cache + activations), switch (source cache, float32 span,
    gathered and transposed translation inputs, output, target cache) or re-prefill (target
    cache + activations). Paths run one after the other, so the largest counts."""
    s, t, c = pair.source.geometry, pair.target.geometry, translator.config
    kv_s = 2 * s.layers * s.kv_heads * s.head_dim * n
    kv_t = 2 * t.layers * t.kv_heads * t.head_dim * n
    chunk = min(n, 4096)  # Translator.translate works in chunks of 4096 tokens
    gathered = 2 * t.layers * max(c.nu_k, c.nu_v) * s.kv_heads * s.head_dim * chunk
    source = 4 * kv_s + _activation_bytes(pair.source, n)
    switch = 4 * (2 * kv_s + 2 * gathered + 2 * kv_t)
    reprefill = 4 * kv_t + _activation_bytes(pair.target, n)
    return max(source, switch, reprefill)


# -- one measurement of each path -------------------------------------------------------------


def _first_token(model, last: mx.array, cache) -> mx.array:
    """One forward step on the last prompt token and greedy sampling, as mlx-lm does."""
    logits = model(last[None], cache=cache)[:, -1, :]
    y = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
    mx.eval(y)
    return y


class _Clock:
    """Wall time and MLX peak memory of consecutive phases."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    def __call__(self, phase: str, fn: Callable):
        mx.reset_peak_memory()
        t = time.perf_counter()
        out = fn()
        self.times[phase] = time.perf_counter() - t
        self.peaks[phase] = mx.get_peak_memory()
        return out


def run_reprefill(target: LoadedModel, tokens: list[int], clock: _Clock) -> None:
    """Target TTFT from scratch: prefill n-1 tokens in mlx-lm's chunks, then the first token."""

    def prefill_all():
        cache, prompt = new_cache(target), mx.array(tokens[:-1])
        for s in range(0, prompt.size, PREFILL_STEP):
            target.model(prompt[s : s + PREFILL_STEP][None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()
        return cache

    cache = clock("target_prefill", prefill_all)
    clock("target_step_reprefill", lambda: _first_token(target.model, mx.array(tokens[-1:]), cache))
    clock.times["target_ttft"] = (
        clock.times["target_prefill"] + clock.times["target_step_reprefill"]
    )
    clock.peaks["target_ttft"] = max(
        clock.peaks["target_prefill"], clock.peaks["target_step_reprefill"]
    )


def run_switch(
    pair: ModelPair, tr: Translator, tokens: list[int], clock: _Clock, gemm_inputs: list
) -> None:
    """The conversation's own hand-off (the small model reads, translation; the large model
    reads only the last token: `Session.hand_off`), the target's first step; then the side
    measurements of the translation's parts."""
    plain = ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0.0)
    session = Session(pair, tr, policy=plain, read_costs=ReadCosts())
    session.add_tokens(tokens)
    stats = clock("handoff", lambda: session.hand_off("target"))
    for phase, seconds in (("source_prefill", stats.read.seconds),
                           ("translate", stats.switch.seconds)):  # fmt: skip
        clock.times[phase] = seconds
        clock.peaks[phase] = clock.peaks["handoff"]
    del clock.times["handoff"], clock.peaks["handoff"]  # recorded as its two phases
    tgt_cache, src_cache = session.cache("target"), session.cache("source")
    last = mx.array(tokens[-1:])
    clock("target_step", lambda: _first_token(pair.target.model, last, tgt_cache))
    clock.times["switch_ttft"] = clock.times["translate"] + clock.times["target_step"]
    clock.peaks["switch_ttft"] = max(clock.peaks["translate"], clock.peaks["target_step"])
    tgt_cache.clear()
    clock("source_step", lambda: _first_token(pair.source.model, last, src_cache))
    # the span the hand-off read, from the small model's cache (read again only where the
    # translator wants keys the cache does not keep)
    cut, n = tr.config.key_cut, len(tokens) - 1
    if needs_recording(pair.source, cut):
        span = prefill(pair.source, tokens[:-1], new_cache(pair.source), cut=cut)
    else:
        span = capture_from_cache(pair.source, src_cache, 0, n)
    mapped = clock("translate_map", lambda: _evaluated(tr(span)))
    bare = replace(span, tokens=None)  # the anchor token, if any, is written apart
    finished = clock("translate_steps", lambda: _evaluated(tr.finish(*mapped, bare, pair.target)))
    clock("cache_append", lambda: append_kv(new_cache(pair.target), *finished))
    clock("gemm", lambda: mx.eval([a @ w for a, w in gemm_inputs]))


def _evaluated(arrays):
    mx.eval(arrays)
    return arrays


def map_weights(tr: Translator) -> list[mx.array]:
    """The matrices the translator multiplies by: one weight per kind, or a low-rank
    translator's encoder and decoder per kind."""
    return [p[n] for p in (tr.key, tr.value) for n in ("weight", "encoder", "decoder") if n in p]


def gemm_operands(tr: Translator, n_tokens: int) -> list[tuple[mx.array, mx.array]]:
    """(activations, weights) with exactly the translator's matmul shapes for n_tokens."""
    out = []
    for w in map_weights(tr):
        a = mx.random.normal((*w.shape[:-2], n_tokens, w.shape[-2])).astype(w.dtype)
        out.append((a, w))
    mx.eval(out)
    return out


def kernel_work(tr: Translator, n_tokens: int) -> tuple[float, float]:
    """(FLOPs, minimum bytes moved) of the translator's matmuls for n_tokens (batch 1)."""
    flops = nbytes = 0.0
    for w in map_weights(tr):
        item = w.dtype.size
        flops += 2.0 * n_tokens * w.size
        rows = w.size // (w.shape[-2] * w.shape[-1])
        nbytes += item * (w.size + rows * n_tokens * (w.shape[-2] + w.shape[-1]))
    return flops, nbytes


# -- the sweep -------------------------------------------------------------------------------


@dataclass
class Skipped:
    length: int
    reason: str


def prompt_tokens(pair: ModelPair, n: int, seed: int) -> list[int]:
    """n random ids from the shared tokenizer's ordinary vocabulary (timing needs no text)."""
    vocab = len(pair.tokenizer.get_vocab()) if hasattr(pair.tokenizer, "get_vocab") else 256
    high = max(2, min(vocab, pair.target.config.get("vocab_size", vocab)) - 8)
    return np.random.default_rng(seed).integers(0, high, size=n).tolist()


def run_bench(
    pair: ModelPair,
    translator: Translator,
    lengths: Sequence[int] = (64, 256, 1024, 4096),
    *,
    trials: int = 3,
    warmup: int = 1,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    info: dict | None = None,
    answer_tokens: int = 16,
    ahead_share: float = 0.10,
) -> dict:
    """Measure every phase at every length; return the results dict (raw trials included).

    `answer_tokens` and `ahead_share` describe the cascade+ahead policy of the escalation
    table: the small model answers that many tokens before an escalation, translating ahead
    within that share of its decode time (see `ahead_switch_ttft`).

    Warm-up rounds run every length, as trial rounds do, and are not recorded: they touch
    every weight and kernel, and the heap grows to each length's buffers before a measured
    trial (on a machine that hands freed memory back to its host, a trial that grows it pays
    for fresh pages: `fresh_memory`). Then each trial round runs every length, both paths, in
    an order that alternates by round.
    A length is skipped, with a message, when its estimated memory exceeds what is available,
    or (with `max_seconds`) when its trials, extrapolated from the shorter lengths, would
    overrun the time budget.
    """
    if trials < 1 or warmup < 0:
        raise ValueError("need trials >= 1 and warmup >= 0")
    lengths = sorted({int(n) for n in lengths})
    if lengths[0] < 2:
        raise ValueError("prefix lengths must be >= 2 (the target processes the last token)")
    translator.check_target(pair.target)
    started = time.perf_counter()
    # how the maps read the source: measured on this pair's shapes, as a warm-up at load does
    reading = measure_map_reading(translator)
    resident = mx.get_active_memory()  # the loaded weights (and anything else alive)
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine_info(),
        "software": report.software_info(),
        "pair": pair_info(pair, translator, **(info or {})),
        "settings": {
            "lengths": lengths,
            "trials": trials,
            "warmup": warmup,
            "seed": seed,
            "prefill_step": PREFILL_STEP,
            "max_seconds": max_seconds,
            "answer_tokens": answer_tokens,
            "ahead_share": ahead_share,
            "sampling": "greedy",
            "order": "warm-up rounds at every length, not recorded; then per round every "
            "length runs both paths, their order alternating by round",
        },
        "phases": {k: v[0] for k, v in PHASES.items()},
        "resident_before_GB": resident / 1e9,
        "map_reading": reading_info(reading),
        "skipped": [],
        "lengths": {},
    }
    raw = {n: {"times": {}, "peaks": {}} for n in lengths}
    round_time: dict[int, float] = {}
    kept, checked = list(lengths), set()
    rounds = warmup + trials
    tokens = prompt_tokens(pair, lengths[-1], seed)
    bar = _Progress(progress, total=rounds * len(lengths))
    if warmup:  # as the runtime's warm-up does: no first translation faults memory in
        have = available_memory()
        fits = [n for n in lengths if working_bytes(pair, translator, n) <= 0.85 * have]
        if fits:
            reserve_translation_memory(pair.target, translator, max(fits))
    with bar:
        for rnd in range(rounds):
            warm = rnd < warmup
            for n in list(kept):
                bar.update(f"{'warm-up' if warm else 'trial'} {rnd + 1}/{rounds} · n={n}")
                if n not in checked:
                    checked.add(n)
                    why = _why_skip(pair, translator, n, round_time, trials, started, max_seconds)
                    if why:
                        log(f"skipping n={n}: {why}")
                        results["skipped"].append({"length": n, "reason": why})
                        kept.remove(n)
                        bar.advance(rounds - rnd)
                        continue
                t0 = time.perf_counter()
                clock = _Clock()
                gemm_in = gemm_operands(translator, n - 1)
                for path in ("reprefill", "switch") if rnd % 2 == 0 else ("switch", "reprefill"):
                    if path == "reprefill":
                        run_reprefill(pair.target, tokens[:n], clock)
                    else:
                        run_switch(pair, translator, tokens[:n], clock, gemm_in)
                    mx.clear_cache()
                del gemm_in
                round_time[n] = time.perf_counter() - t0
                if not warm:
                    for phase, t in clock.times.items():
                        raw[n]["times"].setdefault(phase, []).append(t)
                        raw[n]["peaks"].setdefault(phase, []).append(clock.peaks[phase])
                bar.advance()
    for n in kept:
        results["lengths"][str(n)] = _length_summary(
            n, raw[n], translator, answer_tokens, ahead_share
        )
    results["targets"] = check_targets(results)
    results["elapsed_s"] = time.perf_counter() - started
    results["machine"]["load_average_end"] = report.load_average()
    return results


def _warmed(settings: dict) -> str:
    # files written before warm-up covered every length say so in their "order"
    if settings.get("order", "").startswith("warm-up rounds at the shortest"):
        return f"n={settings['lengths'][0]}"
    return "every length"


def _why_skip(pair, tr, n, round_time, trials, started, max_seconds) -> str | None:
    need, have = working_bytes(pair, tr, n), available_memory()
    if need > 0.85 * have:
        return f"needs ~{need / 1e9:.1f} GB beyond the weights, {have / 1e9:.1f} GB available"
    done = sorted(m for m in round_time if m < n)
    if max_seconds is None or not done:
        return None
    est = extrapolate({m: round_time[m] for m in done}, n)
    spent = time.perf_counter() - started
    ahead = sum(round_time[m] for m in done) * (trials - 1) + est * trials
    if spent + ahead > max_seconds:
        return (
            f"~{est * trials:.0f} s for its {trials} trials (extrapolated from n={done[-1]}) "
            f"would overrun the {max_seconds:.0f} s budget ({spent:.0f} s spent)"
        )
    return None


def extrapolate(times: dict[int, float], n: int) -> float:
    """Time at length n from the two longest measured lengths, as a power law t ~ n^e with
    e clamped to [1, 2] (prefill is between linear and quadratic); e = 1.5 from one point."""
    xs = sorted(times)
    e = 1.5
    if len(xs) >= 2 and times[xs[-2]] > 0:
        e = math.log(times[xs[-1]] / times[xs[-2]]) / math.log(xs[-1] / xs[-2])
        e = min(2.0, max(1.0, e))
    return times[xs[-1]] * (n / xs[-1]) ** e


def _length_summary(
    n: int, raw: dict, tr: Translator, answer_tokens: int = 16, ahead_share: float = 0.10
) -> dict:
    times = raw["times"]
    stats = {p: summarize(v) for p, v in times.items()}
    med = {p: s["median"] for p, s in stats.items()}
    R, X, P = med["target_ttft"], med["switch_ttft"], med["source_prefill"]
    S = P + med["source_step"]
    flops, nbytes = kernel_work(tr, n - 1)
    XA = ahead_switch_ttft(
        translate=med["translate"], target_step=med["target_step"],
        source_step=med["source_step"], answer_tokens=answer_tokens, share=ahead_share,
    )  # fmt: skip
    lines = policy_lines(
        source_ttft=S, source_prefill=P, target_ttft=R, switch_ttft=X, ahead_ttft=XA
    )
    grid = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]
    speedups = [
        switch_speedup(r, x)
        for r, x in zip(times["target_ttft"], times["switch_ttft"], strict=True)
    ]
    e2e = [
        end_to_end_speedup(r, p, x)
        for r, p, x in zip(
            times["target_ttft"], times["source_prefill"], times["switch_ttft"], strict=True
        )
    ]
    return {
        "tokens": n,
        "trials": times,
        "peak_memory": raw["peaks"],
        "stats": stats,
        "derived": {
            "switch_speedup": switch_speedup(R, X),
            "switch_speedup_trials": summarize(speedups),
            "end_to_end_speedup": end_to_end_speedup(R, P, X),
            "end_to_end_speedup_trials": summarize(e2e),
            "translation_vs_target_step": med["translate"] / med["target_step"],
            # the floor of the line above: the translator's matmuls alone, as a plain GEMM
            "gemm_vs_target_step": med["gemm"] / med["target_step"],
            "translation_vs_target_prefill": med["translate"] / med["target_prefill"],
            "source_ttft": S,
            "ahead_switch_ttft": XA,
            "ahead_switch_ttft_in_steps": XA / med["target_step"],
            "translate_ms_per_token": 1e3 * med["translate"] / (n - 1),
            "translate_gflops": flops / med["translate"] / 1e9,
            "translate_gbs": nbytes / med["translate"] / 1e9,
            "map_gflops": flops / med["translate_map"] / 1e9,
            "gemm_gflops": flops / med["gemm"] / 1e9,
            "gemm_gbs": nbytes / med["gemm"] / 1e9,
            "gemm_efficiency": med["gemm"] / med["translate"],
            "map_efficiency": med["gemm"] / med["translate_map"],
            # the translation's steps one by one, each as efficiency up to and including it
            "step_efficiency": step_efficiency(med),
            "kernel_flops": flops,
            "kernel_bytes": nbytes,
            "peak_memory_GB": {p: max(v) / 1e9 for p, v in raw["peaks"].items()},
        },
        "policies": {
            "lines": {k: {"intercept": a, "slope": b} for k, (a, b) in lines.items()},
            "grid": {
                "r": grid,
                **{k: [a + b * r for r in grid] for k, (a, b) in lines.items()},
            },
            "break_even": {
                "cascade_reprefill_vs_always_large": break_even(
                    lines["cascade_reprefill"], lines["always_large"]
                ),
                "cascade_translate_vs_always_large": break_even(
                    lines["cascade_translate"], lines["always_large"]
                ),
                "cascade_reprefill_cheaper_up_to": cheaper_up_to(
                    lines["cascade_reprefill"], lines["always_large"]
                ),
                "cascade_translate_cheaper_up_to": cheaper_up_to(
                    lines["cascade_translate"], lines["always_large"]
                ),
                "cascade_ahead_cheaper_up_to": cheaper_up_to(
                    lines["cascade_ahead"], lines["always_large"]
                ),
                "cascade_translate_beats_route_first": P + X < R,
                "cascade_translate_beats_cascade_reprefill": X < R,
            },
        },
    }


def step_efficiency(med: dict) -> dict:
    """Same-run GEMM time over the time of the translation's steps up to each one: the maps,
    then + the target-side steps, then + the cache writes (the last is ~ `gemm_efficiency`,
    measured as one call; the parts are measured separately)."""
    out, spent = {}, 0.0
    for step in ("translate_map", "translate_steps", "cache_append"):
        if step not in med:
            return out
        spent += med[step]
        out[step] = {"ms": 1e3 * med[step], "cumulative_efficiency": med["gemm"] / spent}
    return out


def reading_info(reading) -> dict | None:
    """The map-reading strategy measured per kind and token count (None: not measured)."""
    if not reading.chosen:  # a translator with one path (lowrank)
        return None
    return {
        f"{kind}@{n}": {
            "chosen": reading.chosen[(kind, n)],
            "ms": {k: 1e3 * v for k, v in reading.timings[(kind, n)].items()},
        }
        for kind, n in reading.chosen
    }


def check_targets(results: dict) -> dict:
    """The issue's four performance targets, with the measured values and margins."""
    lens = {int(n): v for n, v in results["lengths"].items()}
    out = {}
    if not lens:
        return out
    n0 = min(lens)
    d0 = lens[n0]["derived"]
    out["translation_vs_step"] = {
        "at": n0,
        "value": d0["translation_vs_target_step"],
        "target": f"<= {TARGETS['translation_vs_step_at_64']}",
        "met": d0["translation_vs_target_step"] <= TARGETS["translation_vs_step_at_64"],
        # a translation at full GEMM efficiency would still cost this much of a step
        "gemm_floor": d0["gemm_vs_target_step"],
    }
    xs = sorted(lens)
    fit = linear_fit([n - 1 for n in xs], [lens[n]["stats"]["translate"]["median"] for n in xs])
    out["linear_growth"] = {
        **fit,
        "ms_per_token": {n: lens[n]["derived"]["translate_ms_per_token"] for n in xs},
        "target": f"R^2 >= {TARGETS['linearity_r2']}",
        "met": fit["r2"] >= TARGETS["linearity_r2"] if len(xs) >= 3 else None,
    }
    eff = {n: lens[n]["derived"]["gemm_efficiency"] for n in xs}
    out["gemm_efficiency"] = {
        "value": eff,
        "min": min(eff.values()),
        "target": f">= {TARGETS['gemm_efficiency']}",
        "met": min(eff.values()) >= TARGETS["gemm_efficiency"],
    }
    out["switch_speedup"] = {
        "at": n0,
        "value": d0["switch_speedup"],
        "target": f">= {TARGETS['switch_speedup_at_64']}",
        "met": d0["switch_speedup"] >= TARGETS["switch_speedup_at_64"],
    }
    return out


# -- progress --------------------------------------------------------------------------------


class _Progress:
    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar, self.task = enabled, total, None, None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("bench", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def update(self, description: str):
        if self.bar:
            self.bar.update(self.task, description=description)

    def advance(self, k: int = 1):
        if self.bar:
            self.bar.advance(self.task, k)

    def skip(self, k: int):
        self.advance(k)


# -- outputs -------------------------------------------------------------------------------


def _ms(s: dict) -> str:
    return f"{1e3 * s['mean']:.2f} ± {1e3 * s['std']:.2f}"


def _tps(values: Sequence[float], tokens: int) -> str:
    r = tokens / np.asarray(values, float)
    return f"{r.mean():.2f} ± {r.std(ddof=1) if r.size > 1 else 0.0:.2f}"


def _r(x: float) -> str:
    return {0.0: "none (never cheaper)", 1.0: "1.00 (all rates)"}.get(x, f"{x:.2f}")


def markdown_report(results: dict) -> str:
    """llama-bench-style tables (mean ± std over trials), derived figures, targets."""
    p, m, sw, st = results["pair"], results["machine"], results["software"], results["settings"]
    base = results.get("resident_before_GB", 0.0)
    tr = p["translator"]
    head = [
        "# kvlingo bench",
        "",
        f"source `{p['source']['name']}` → target `{p['target']['name']}` · translator "
        f"{tr['variant']} nu={tr['nu'][0]} {tr['key_cut']} {tr['dtype']}"
        + (f" ({p['translator_weights']})" if p.get("translator_weights") else "")
        + f" · models {p['source']['dtype']}/{p['target']['dtype']}",
        f"{m['backend']} · {m['cpu']} ({m['cpu_count']} cores, {m['memory_GB']} GB) · "
        f"BLAS {m['blas']} · mlx {sw['mlx']} · mlx-lm {sw['mlx-lm']} · {m['os']}",
        f"{st['trials']} trials after {st['warmup']} warm-up round(s) at {_warmed(st)}; "
        f"load average at start {_load(m.get('load_average'))}, at end "
        f"{_load(m.get('load_average_end'))}; {base:.2f} GB resident "
        "before the run (weights)",
        "",
        *md_table(("path", "phase", "test", "ms", "t/s", "median ms", "peak GB (+ over resident)"),
                  "lllrrrr"),
    ]  # fmt: skip
    rows = [
        ("source", "source_prefill", "pp{}"),
        ("source", "source_step", "tg1@{}"),
        ("re-prefill", "target_prefill", "pp{}"),
        ("re-prefill", "target_step_reprefill", "tg1@{}"),
        ("re-prefill", "target_ttft", "ttft{}"),
        ("switch", "translate", "tr{}"),
        ("switch", "target_step", "tg1@{}"),
        ("switch", "switch_ttft", "tr{}+tg1"),
        ("kernel", "translate_map", "mm{}"),
        ("kernel", "gemm", "mm{}"),
    ]
    body = []
    for key, v in results["lengths"].items():
        n = int(key)
        for path, phase, test in rows:
            s = v["stats"][phase]
            ntok = PHASES[phase][1](n)
            shown = n if phase == "target_ttft" else n - 1
            body.append(md_row((
                path, PHASES[phase][0], test.format(shown), _ms(s),
                _tps(v["trials"][phase], ntok), f"{1e3 * s['median']:.2f}",
                _peak(v["derived"]["peak_memory_GB"][phase], base),
            )))  # fmt: skip
    derived = [
        "",
        "## Derived (medians)",
        "",
        *md_table(("n", "switch speed-up R/X", "end-to-end R/(P+X)", "translation / target step",
                   "translation / target prefill", "translation GFLOP/s", "GB/s", "GEMM GFLOP/s",
                   "GB/s", "efficiency (matmuls alone)"), "r" * 10),
    ]  # fmt: skip
    for key, v in results["lengths"].items():
        d = v["derived"]
        sp, e2 = d["switch_speedup_trials"], d["end_to_end_speedup_trials"]
        derived.append(md_row((
            key, f"{d['switch_speedup']:.2f}x ({sp['min']:.2f}–{sp['max']:.2f})",
            f"{d['end_to_end_speedup']:.2f}x ({e2['min']:.2f}–{e2['max']:.2f})",
            f"{100 * d['translation_vs_target_step']:.1f}%",
            f"{100 * d['translation_vs_target_prefill']:.1f}%", f"{d['translate_gflops']:.1f}",
            f"{d['translate_gbs']:.2f}", f"{d['gemm_gflops']:.1f}", f"{d['gemm_gbs']:.2f}",
            f"{100 * d['gemm_efficiency']:.0f}% ({100 * d['map_efficiency']:.0f}%)",
        )))  # fmt: skip
    pol = [
        "",
        "## Expected TTFT per request (ms) against the escalation rate r",
        "",
        "S = source TTFT, P = source prefill, R = target re-prefill TTFT, X = switch TTFT, "
        "X_ahead = one target step + the translation left after translating ahead within "
        f"{st.get('ahead_share', 0.1):.0%} of a {st.get('answer_tokens', 16)}-token small answer's "
        "decode time. always large: R · route first: (1-r)S + rR · cascade re-prefill: "
        "(1-r)S + r(P+R) · cascade translate: (1-r)S + r(P+X) · cascade+ahead: (1-r)S + r(P+X_ahead).",
        "",
        *md_table(("n", "r", "always large", "route first", "cascade re-prefill",
                   "cascade translate", "cascade+ahead"), "r" * 7),
    ]  # fmt: skip
    for key, v in results["lengths"].items():
        g = v["policies"]["grid"]
        for i, r in enumerate(g["r"]):
            ahead = g.get("cascade_ahead")
            pol.append(md_row((
                key, f"{r:.2f}", *(f"{1e3 * g[k][i]:.1f}" for k in
                ("always_large", "route_first", "cascade_reprefill", "cascade_translate")),
                "" if ahead is None else f"{1e3 * ahead[i]:.1f}",
            )))  # fmt: skip
    pol += ["", "Break-even: a cascade beats always-large for escalation rates up to r*.", "",
            *md_table(("n", "r*: cascade re-prefill", "r*: cascade translate",
                       "r*: cascade+ahead", "cascade translate beats route first (P+X < R)",
                       "X_ahead / target step"), "rrrrlr")]  # fmt: skip
    for key, v in results["lengths"].items():
        b = v["policies"]["break_even"]
        ahead = b.get("cascade_ahead_cheaper_up_to")
        steps = v["derived"].get("ahead_switch_ttft_in_steps")
        pol.append(md_row((
            key, _r(b["cascade_reprefill_cheaper_up_to"]), _r(b["cascade_translate_cheaper_up_to"]),
            "" if ahead is None else _r(ahead),
            "yes" if b["cascade_translate_beats_route_first"] else "no",
            "" if steps is None else f"{steps:.2f}",
        )))  # fmt: skip
    return "\n".join(head + body + derived + _steps_md(results) + pol + _targets_md(results)) + "\n"


def _steps_md(results: dict) -> list[str]:
    """Where the translation's time goes, step by step, against the same-run GEMM."""
    rows = [(k, v["derived"].get("step_efficiency")) for k, v in results["lengths"].items()]
    if not any(steps for _, steps in rows):
        return []
    out = [
        "",
        "## Translation step by step (medians; efficiency = same-run GEMM time / time so far)",
        "",
        "| n | maps ms | eff. | + target-side steps ms | eff. | + cache writes ms | eff. | "
        "one call (translation) eff. |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, steps in rows:
        if not steps:
            continue
        cells = " | ".join(
            f"{s['ms']:.2f} | {100 * s['cumulative_efficiency']:.0f}%" for s in steps.values()
        )
        eff = results["lengths"][key]["derived"]["gemm_efficiency"]
        out.append(f"| {key} | {cells} | {100 * eff:.0f}% |")
    reading = results.get("map_reading")
    if reading:
        out += ["", "Map reading measured at load: " + ", ".join(
            f"{k} {v['chosen']} (" + "/".join(f"{s} {ms:.2f} ms" for s, ms in v["ms"].items()) + ")"
            for k, v in reading.items()
        )]  # fmt: skip
    return out


def _peak(peak: float, resident: float) -> str:
    return f"{peak:.2f} (+{max(0.0, peak - resident):.2f})"


def _load(x) -> str:
    return "n/a" if not x else "/".join(f"{v:.1f}" for v in x)


def _targets_md(results: dict) -> list[str]:
    t = results.get("targets") or {}
    if not t:
        return []

    def mark(ok):
        return "n/a" if ok is None else ("met" if ok else "missed")

    a, lin, eff, sp = (
        t["translation_vs_step"], t["linear_growth"], t["gemm_efficiency"], t["switch_speedup"]
    )  # fmt: skip
    per_tok = ", ".join(f"{n}: {v:.3f}" for n, v in lin["ms_per_token"].items())
    out = [
        "",
        "## Performance targets",
        "",
        f"- translation at n={a['at']} vs one target decode step: {100 * a['value']:.1f}% "
        f"(target <= 10%): {mark(a['met'])}; the same-run GEMM of its matmuls alone: "
        f"{100 * a['gemm_floor']:.1f}%",
        f"- translation grows linearly: R^2 {lin['r2']:.4f} (target >= 0.99), ms per token "
        f"{per_tok}: {mark(lin['met'])}",
        f"- translation vs same-run GEMM throughput: min {100 * eff['min']:.0f}% (target >= 70%): "
        f"{mark(eff['met'])}",
        f"- switch speed-up at n={sp['at']}: {sp['value']:.2f}x (target >= 9.6x): {mark(sp['met'])}",
    ]
    if results.get("skipped"):
        out += [
            "",
            "Skipped: " + "; ".join(f"n={s['length']}: {s['reason']}" for s in results["skipped"]),
        ]
    return out


def plot(results: dict, path: str | Path) -> Path:
    """TTFT against prefix length per path, log-log, min-max bars over trials."""
    plt = report.pyplot()
    lens = sorted(int(n) for n in results["lengths"])
    fig, ax = plt.subplots(figsize=(7, 4.5))

    def series(fn):
        per = [np.asarray(fn(results["lengths"][str(n)]["trials"]), float) * 1e3 for n in lens]
        med = np.array([np.median(v) for v in per])
        return med, np.array([med - [v.min() for v in per], [v.max() for v in per] - med])

    curves = {
        "target re-prefill TTFT (R)": lambda t: t["target_ttft"],
        "switch TTFT: translation + first step (X)": lambda t: t["switch_ttft"],
        "cascade switch: source prefill + X": lambda t: np.add(
            t["source_prefill"], t["switch_ttft"]
        ),
        "source TTFT (S)": lambda t: np.add(t["source_prefill"], t["source_step"]),
        "translation alone": lambda t: t["translate"],
    }
    for (label, fn), style in zip(curves.items(), ("o-", "s-", "^--", "v:", "x-."), strict=True):
        med, err = series(fn)
        ax.errorbar(lens, med, yerr=np.maximum(err, 0), fmt=style, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time (ms)")
    p = results["pair"]
    ax.set_title(f"{p['source']['name']} → {p['target']['name']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path)


def write_outputs(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """bench.json (everything, raw trials included), bench.md and ttft.png in `out_dir`."""
    paths = report.output_files(out_dir, json="bench.json", markdown="bench.md", plot="ttft.png")
    report.write_json(results, paths["json"])
    paths["markdown"].write_text(markdown_report(results))
    if results["lengths"]:
        plot(results, paths["plot"])
    else:
        del paths["plot"]
    return paths
