"""Time to first token when the large model takes over a prompt of n tokens, on this machine:

    re-prefill   target prefill of n-1 tokens, then one step on the last            R
    switch       the source's prefill of n-1 tokens (P), the hand-off's
                 translation (`Session.hand_off`), then the target's step           X
    specprefill  speculative prefill at kept share k (`kv/sparse_prefill.py`),
                 then the target's step on the last at position n-1                Q_k

Reported as shares of R: (P+X)/R (ours) beside Q_k/R (the peer), and the paper's speed-up R/X.
The maps alone and a plain GEMM of their shapes run in the same round (efficiency = a ratio
within one run). Every run records the goals (`TARGETS`) in `targets`: flagged, not asserted.
Trial rounds alternate the paths' order, after unrecorded warm-up rounds; peak memory is MLX's
allocator peak during the phase, weights included.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mlx_kvlingo.conversation.session import READ_CHUNK
from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.content import Chat, Peer, read
from mlx_kvlingo.eval.report import md_row, md_table
from mlx_kvlingo.kv.sparse_prefill import positions_shifted, speculative_prefill
from mlx_kvlingo.kv.translator import Translator, reserve_translation_memory
from mlx_kvlingo.kv.translator import measure as measure_map_reading
from mlx_kvlingo.models.pair import LoadedModel, ModelPair, describe_model, physical_memory

import mlx.core as mx
import numpy as np

SCHEMA = "mlx-kvlingo/bench"
SCHEMA_VERSION = 2

#: phase key -> (path, label, llama-bench test name of n and m = n-1, tokens it processes for a
#: prompt of n tokens); the peer's are `peer_phase`'s
PHASES: dict[str, tuple[str, str, str, Callable[[int], int]]] = {
    "source_prefill": ("source", "source prefill + capture", "pp{m}", lambda n: n - 1),
    "target_prefill": ("re-prefill", "target prefill (n-1)", "pp{m}", lambda n: n - 1),
    "target_step_reprefill": ("re-prefill", "target first step after its prefill", "tg1@{m}",
                              lambda n: 1),
    "target_ttft": ("re-prefill", "target re-prefill TTFT", "ttft{n}", lambda n: n),
    "translate": ("switch", "translation", "tr{m}", lambda n: n - 1),
    "target_step": ("switch", "target first step after translation", "tg1@{m}", lambda n: 1),
    "switch_ttft": ("switch", "switch TTFT (translation + step)", "tr{m}+tg1", lambda n: n),
    "translate_map": ("kernel", "translator maps alone", "map{m}", lambda n: n - 1),
    "gemm": ("kernel", "plain GEMM, same shapes", "mm{m}", lambda n: n - 1),
}  # fmt: skip
#: the goals every run is checked against (`check_targets`): GEMM efficiency at every length,
#: the translation over one target step and the speed-up R/X at the shortest length
TARGETS = {"gemm_efficiency": 0.70, "translation_vs_target_step": 0.12, "switch_speedup": 9.0}


def peer_phase(keep: float) -> str:
    """The phase key of speculative prefill at kept share `keep` (its TTFT, scoring included)."""
    return f"specprefill {keep:g}"


def phase_row(key: str) -> tuple[str, str, str, Callable[[int], int]]:
    """A phase's (path, label, test name, tokens), the peer's included."""
    if key in PHASES:
        return PHASES[key]
    keep = key.split()[-1]
    return "specprefill", f"speculative prefill TTFT, {keep} kept", f"sp{keep}@{{n}}", lambda n: n


def extrapolate(times: dict[int, float], n: int) -> float:
    """Time at length n from the two longest measured lengths, as a power law t ~ n^e with
    e clamped to [1, 2] (prefill is between linear and quadratic); e = 1.5 from one point."""
    xs = sorted(times)
    e = 1.5
    if len(xs) >= 2 and times[xs[-2]] > 0:
        e = math.log(times[xs[-1]] / times[xs[-2]]) / math.log(xs[-1] / xs[-2])
        e = min(2.0, max(1.0, e))
    return times[xs[-1]] * (n / xs[-1]) ** e


def available_memory() -> int:
    """Bytes that can still be allocated (MemAvailable on Linux; Metal's working set else)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        return int(re.search(r"MemAvailable:\s+(\d+)", meminfo.read_text())[1]) * 1024
    if mx.metal.is_available():
        info = mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size", 0)) - mx.get_active_memory()
    return physical_memory() - mx.get_active_memory()


def working_bytes(pair: ModelPair, translator: Translator, n: int) -> int:
    """Rough float32 bytes beyond the weights of the largest phase at length n: the switch's
    K/V of both models, span and gathered inputs (4096-token chunks), or one read's K/V and
    chunk scores, mask and softmax."""
    s, t, c = pair.source.geometry, pair.target.geometry, translator.config
    kv = {m: 2 * g.layers * g.kv_heads * g.head_dim * n for m, g in (("s", s), ("t", t))}
    gathered = 2 * t.layers * max(c.nu_k, c.nu_v) * s.kv_heads * s.head_dim * min(n, 4096)
    chunk = min(n, READ_CHUNK)
    reads = [kv[k] + 3 * m.config["num_attention_heads"] * chunk * n
             for k, m in (("s", pair.source), ("t", pair.target))]  # fmt: skip
    return 4 * max(*reads, 2 * kv["s"] + 2 * gathered + 2 * kv["t"])


def gemm_operands(tr: Translator, n_tokens: int) -> list[tuple[mx.array, mx.array]]:
    """(activations, weights) with exactly the translator's matmul shapes for n_tokens."""
    out = [(mx.random.normal((*w.shape[:-2], n_tokens, w.shape[-2])).astype(w.dtype), w)
           for w in (tr.key["weight"], tr.value["weight"])]  # fmt: skip
    mx.eval(out)
    return out


def kernel_work(tr: Translator, n_tokens: int) -> tuple[float, float]:
    """(FLOPs, minimum bytes moved) of the translator's matmuls for n_tokens (batch 1)."""
    flops = nbytes = 0.0
    for w in (tr.key["weight"], tr.value["weight"]):  # the matrices the maps multiply by
        flops += 2.0 * n_tokens * w.size
        rows = w.size // (w.shape[-2] * w.shape[-1])
        nbytes += w.dtype.size * (w.size + rows * n_tokens * (w.shape[-2] + w.shape[-1]))
    return flops, nbytes


def first_token(model, last: mx.array, cache) -> mx.array:
    """One forward step on the last prompt token and greedy sampling, as mlx-lm does."""
    logits = model(last[None], cache=cache)[:, -1, :]
    y = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
    mx.eval(y)
    return y


class _Clock(dict):
    """phase -> (wall seconds, MLX peak memory) of consecutive phases."""

    def __call__(self, phase: str, fn: Callable):
        mx.reset_peak_memory()
        t = time.perf_counter()
        out = fn()
        self[phase] = (time.perf_counter() - t, mx.get_peak_memory())
        return out

    def total(self, phase: str, *parts: str) -> None:
        """`phase` as the sum of `parts` (peak: the largest)."""
        self[phase] = (sum(self[p][0] for p in parts), max(self[p][1] for p in parts))


def run_reprefill(target: LoadedModel, tokens: list[int], clock: _Clock) -> None:
    """Target TTFT from scratch: prefill n-1 tokens in the chat's chunks, then the first token."""
    cache = clock("target_prefill", lambda: read(target, tokens[:-1]))
    clock("target_step_reprefill", lambda: first_token(target.model, mx.array(tokens[-1:]), cache))
    clock.total("target_ttft", "target_prefill", "target_step_reprefill")


def run_switch(
    pair: ModelPair, tr: Translator, tokens: list[int], clock: _Clock, gemm_inputs: list
) -> None:
    """The chat's hand-off (`Session.hand_off`, the large model reading the last token only),
    the target's first step, the maps alone on the span read and a GEMM of their shapes."""
    mx.reset_peak_memory()
    session, stats = Chat(tr, 1, 0.0).hand_off(pair, tokens)
    peak = mx.get_peak_memory()
    clock["source_prefill"] = (stats.read.seconds, peak)
    clock["translate"] = (stats.switch.seconds, peak)
    last = mx.array(tokens[-1:])
    clock("target_step", lambda: first_token(pair.target.model, last, session.cache("target")))
    clock.total("switch_ttft", "translate", "target_step")
    # the span the hand-off translated, captured as the session captures it
    span = session.capture(session.models["source"], tr, 0, len(tokens) - 1)
    mx.eval(span.keys, span.values)
    clock("translate_map", lambda: mx.eval(tr(span)))
    clock("gemm", lambda: mx.eval([a @ w for a, w in gemm_inputs]))


def run_peer(pair: ModelPair, tokens: list[int], peer: Peer, clock: _Clock) -> int:
    """The peer's TTFT (`speculative_prefill`, then the target's step on the last token at
    position n-1); the entries its cache held before that step."""

    def read_and_step() -> int:
        mx.random.seed(peer.seed)
        cache, _ = speculative_prefill(pair, tokens, peer.keep)
        held = cache[0].offset  # before the step on the last token
        with positions_shifted(pair.target, len(tokens) - 1 - held):
            first_token(pair.target.model, mx.array(tokens[-1:]), cache)
        return held

    return clock(peer_phase(peer.keep), read_and_step)


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
    keeps: Sequence[float] = (),
    max_seconds: float | None = None,
    progress: Callable[..., None] | None = None,
    log: Callable[[str], None] = print,
    info: dict | None = None,
) -> dict:
    """Every phase at every length (raw trials included); the peer at each of `keeps`. A
    length is skipped (logged) when its memory estimate exceeds what is available, or when its
    trials, extrapolated, would overrun `max_seconds`; `progress(done, total, note)` per round."""
    lengths = sorted({int(n) for n in lengths})
    peers = [Peer(float(k), seed) for k in dict.fromkeys(keeps)]
    translator.check_target(pair.target)
    started = time.perf_counter()
    reading = measure_map_reading(translator)  # as a warm-up at load does
    resident = mx.get_active_memory()  # the loaded weights (and anything else alive)
    c, weights = translator.config, (translator.key["weight"], translator.value["weight"])
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        **report.run_info(),
        "pair": {
            "source": describe_model(pair.source),
            "target": describe_model(pair.target),
            "tokenizer": pair.tokenizer_fingerprint,
            "translator": {
                "variant": c.variant, "nu": [c.nu_k, c.nu_v], "key_cut": c.key_cut, "bias": c.bias,
                "dtype": str(weights[0].dtype).replace("mlx.core.", ""),
                "parameters": sum(int(w.size) for w in weights),
                "provenance": c.metadata.get("provenance"),
            },
            **(info or {}),
        },
        "settings": {
            "lengths": lengths, "trials": trials, "warmup": warmup, "seed": seed,
            "specprefill_keep": [p.keep for p in peers], "prefill_step": READ_CHUNK,
            "max_seconds": max_seconds, "sampling": "greedy",
        },
        "resident_before_GB": resident / 1e9,
        # the map-reading strategy measured per kind and token count (None: one path only)
        "map_reading": {f"{kind}@{n}": {"chosen": reading.chosen[(kind, n)],
                                        "ms": {k: 1e3 * v for k, v in reading.timings[(kind, n)].items()}}
                        for kind, n in reading.chosen} or None,
        "skipped": [],
        "lengths": {},
    }  # fmt: skip
    raw: dict[int, list[tuple[_Clock, dict]]] = {n: [] for n in lengths}  # per trial
    round_time: dict[int, float] = {}  # the last round's seconds per length
    kept = list(lengths)
    rounds, done = warmup + trials, 0
    tokens = prompt_tokens(pair, lengths[-1], seed)
    if warmup:  # as the runtime's warm-up does: no first translation faults memory in
        have = available_memory()
        fits = [n for n in lengths if working_bytes(pair, translator, n) <= 0.85 * have]
        if fits:
            reserve_translation_memory(pair.target, translator, max(fits))
    paths = ["reprefill", "switch", *peers]
    for rnd in range(rounds):
        warm = rnd < warmup
        for n in list(kept):
            if rnd == 0:  # each length is judged once, after the shorter ones ran
                why = _why_skip(pair, translator, n, round_time, trials, started, max_seconds)
                if why:
                    log(f"skipping n={n}: {why}")
                    results["skipped"].append({"length": n, "reason": why})
                    kept.remove(n)
                    done += rounds
                    continue
            t0 = time.perf_counter()
            clock, held = _Clock(), {}
            gemm_in = gemm_operands(translator, n - 1)
            for path in paths if rnd % 2 == 0 else paths[::-1]:
                if path == "reprefill":
                    run_reprefill(pair.target, tokens[:n], clock)
                elif path == "switch":
                    run_switch(pair, translator, tokens[:n], clock, gemm_in)
                else:
                    held[peer_phase(path.keep)] = run_peer(pair, tokens[:n], path, clock)
                mx.clear_cache()
            del gemm_in
            round_time[n] = time.perf_counter() - t0
            if not warm:
                raw[n].append((clock, held))
            done += 1
            if progress:
                progress(done, rounds * len(lengths),
                         note=f"{'warm-up' if warm else 'trial'} {rnd + 1}/{rounds} · n={n}")  # fmt: skip
    for n in kept:
        results["lengths"][str(n)] = _length_summary(n, raw[n], translator, peers)
    results["elapsed_s"] = time.perf_counter() - started
    results["machine"]["load_average_end"] = report.load_average()
    results["targets"] = check_targets(results)
    return results


def check_targets(results: dict) -> dict:
    """Each goal of `TARGETS` with the measured value and whether it was met."""
    lens = {int(n): v["derived"] for n, v in results["lengths"].items()}
    if not lens:
        return {}
    n0 = min(lens)
    eff = {n: d["gemm_efficiency"] for n, d in sorted(lens.items())}
    step, speedup = lens[n0]["translation_vs_target_step"], lens[n0]["switch_speedup"]
    return {
        "gemm_efficiency": {
            "goal": f">= {TARGETS['gemm_efficiency']}", "value": eff,
            "maps_alone": {n: d["map_efficiency"] for n, d in sorted(lens.items())},
            "met": min(eff.values()) >= TARGETS["gemm_efficiency"],
        },
        "translation_vs_target_step": {
            "goal": f"<= {TARGETS['translation_vs_target_step']}", "at": n0, "value": step,
            "gemm_floor": lens[n0]["gemm_vs_target_step"],
            "met": step <= TARGETS["translation_vs_target_step"],
        },
        "switch_speedup": {
            "goal": f">= {TARGETS['switch_speedup']}", "at": n0, "value": speedup,
            "met": speedup >= TARGETS["switch_speedup"],
        },
    }  # fmt: skip


def _why_skip(pair, tr, n, round_time, trials, started, max_seconds) -> str | None:
    need, have = working_bytes(pair, tr, n), available_memory()
    if need > 0.85 * have:
        return f"needs ~{need / 1e9:.1f} GB beyond the weights, {have / 1e9:.1f} GB available"
    if max_seconds is None or not round_time:  # round_time: the shorter lengths' first round
        return None
    est = extrapolate(round_time, n)
    spent = time.perf_counter() - started
    ahead = sum(round_time.values()) * (trials - 1) + est * trials
    if spent + ahead > max_seconds:
        return (f"~{est * trials:.0f} s for its {trials} trials (extrapolated from n={max(round_time)}) "
                f"would overrun the {max_seconds:.0f} s budget ({spent:.0f} s spent)")  # fmt: skip
    return None


def _length_summary(n: int, runs: list, tr: Translator, peers: Sequence[Peer]) -> dict:
    times = {p: [c[p][0] for c, _ in runs] for p in runs[0][0]}
    peaks = {p: [c[p][1] for c, _ in runs] for p in runs[0][0]}
    stats = {p: report.stats(v) for p, v in times.items()}
    med = {p: s["median"] for p, s in stats.items()}
    R, X, P = med["target_ttft"], med["switch_ttft"], med["source_prefill"]
    flops, nbytes = kernel_work(tr, n - 1)
    return {
        "tokens": n,
        "trials": times,
        "peak_memory": peaks,
        "stats": stats,
        # each path's TTFT over the large model's own read (R): ours end to end beside the peer's
        "ttft_over_target": {"ours": (P + X) / R, "switch alone": X / R,
                             **{peer_phase(p.keep): med[peer_phase(p.keep)] / R for p in peers}},
        "specprefill": {peer_phase(p.keep): {"keep": p.keep, "seed": p.seed,
                                             "cache_entries": [h[peer_phase(p.keep)] for _, h in runs]}
                        for p in peers},
        "derived": {
            "switch_speedup": R / X,  # the paper's figure: the source's prefill not counted
            "switch_speedup_trials": report.stats(np.divide(times["target_ttft"], times["switch_ttft"])),
            "translation_vs_target_step": med["translate"] / med["target_step"],
            # the floor of the line above: the translator's matmuls alone, as a plain GEMM
            "gemm_vs_target_step": med["gemm"] / med["target_step"],
            "translation_vs_target_prefill": med["translate"] / med["target_prefill"],
            "translate_gflops": flops / med["translate"] / 1e9,
            "translate_gbs": nbytes / med["translate"] / 1e9,
            "gemm_gflops": flops / med["gemm"] / 1e9,
            "gemm_gbs": nbytes / med["gemm"] / 1e9,
            "gemm_efficiency": med["gemm"] / med["translate"],
            "map_efficiency": med["gemm"] / med["translate_map"],  # the maps alone
            "peak_memory_GB": {p: max(v) / 1e9 for p, v in peaks.items()},
        },
    }  # fmt: skip


def _mean_std(s: dict, scale: float = 1.0) -> str:
    return f"{scale * s['mean']:.2f} ± {scale * s['std']:.2f}"


def markdown_report(results: dict) -> str:
    """bench.md: llama-bench-style tables (mean ± std over trials), TTFT over R, derived, goals."""
    p, m, st, lengths = results["pair"], results["machine"], results["settings"], results["lengths"]
    base, tr = results["resident_before_GB"], p["translator"]
    peers = [peer_phase(k) for k in st["specprefill_keep"]]
    out = [
        "# kvlingo bench",
        "",
        f"source `{p['source']['name']}` → target `{p['target']['name']}` · translator "
        f"{tr['variant']} nu={tr['nu'][0]} {tr['key_cut']} {tr['dtype']}"
        + (f" ({p['translator_weights']})" if p.get("translator_weights") else "")
        + f" · models {p['source']['dtype']}/{p['target']['dtype']}",
        report.machine_line(m, results["software"]),
        f"{st['trials']} trials after {st['warmup']} warm-up round(s) at every length; "
        f"{report.load_span(m)}; {base:.2f} GB resident before the run (weights)",
        "",
        *md_table(("path", "phase", "test", "ms", "t/s", "median ms", "peak GB (+ over resident)"),
                  "lllrrrr"),
    ]  # fmt: skip
    for key, v in lengths.items():
        n = int(key)
        for phase in [*(p for p in PHASES if p in v["trials"]), *peers]:
            path, label, test, tokens = phase_row(phase)
            s, peak = v["stats"][phase], v["derived"]["peak_memory_GB"][phase]
            out.append(md_row((
                path, label, test.format(n=n, m=n - 1), _mean_std(s, 1e3),
                _mean_std(report.stats(tokens(n) / np.asarray(v["trials"][phase]))),
                f"{1e3 * s['median']:.2f}",
                f"{peak:.2f} (+{max(0.0, peak - base):.2f})",
            )))  # fmt: skip
    out += ["", "## Time to first token over the large model's own read (medians)", "",
            "R = the large model reads the prompt itself; ours = the small model reads it and the "
            "hand-off translates it (P + X); speculative prefill = the small model reads and "
            "scores it, the large model reads the kept 32-token chunks (its cache's entries in "
            "brackets, of n-1).", "",
            *md_table(("n", "R ms", "ours (P+X)/R", "switch alone X/R",
                       *(f"{k} kept" for k in peers)), "r" * (4 + len(peers)))]  # fmt: skip
    for key, v in lengths.items():
        ratio, sp = v["ttft_over_target"], v["specprefill"]
        out.append(md_row((
            key, f"{1e3 * v['stats']['target_ttft']['median']:.1f}", f"{ratio['ours']:.2f}",
            f"{ratio['switch alone']:.3f}",
            *(f"{ratio[k]:.2f} ({int(np.median(sp[k]['cache_entries']))})" for k in peers),
        )))  # fmt: skip
    out += ["", "## Derived (medians)", "",
            *md_table(("n", "switch speed-up R/X", "translation (GEMM) / target step",
                       "translation / target prefill", "translation GFLOP/s", "GB/s",
                       "GEMM GFLOP/s", "GB/s", "efficiency vs GEMM (maps alone)"), "r" * 9)]  # fmt: skip
    for key, v in lengths.items():
        d, sp = v["derived"], v["derived"]["switch_speedup_trials"]
        out.append(md_row((
            key, f"{d['switch_speedup']:.2f}x ({sp['min']:.2f}–{sp['max']:.2f})",
            f"{100 * d['translation_vs_target_step']:.1f}% ({100 * d['gemm_vs_target_step']:.1f}%)",
            f"{100 * d['translation_vs_target_prefill']:.1f}%", f"{d['translate_gflops']:.1f}",
            f"{d['translate_gbs']:.2f}", f"{d['gemm_gflops']:.1f}", f"{d['gemm_gbs']:.2f}",
            f"{100 * d['gemm_efficiency']:.0f}% ({100 * d['map_efficiency']:.0f}%)",
        )))  # fmt: skip
    if results["map_reading"]:
        out += ["", "Map reading measured at the start: " + ", ".join(
            f"{k} {v['chosen']} (" + "/".join(f"{s} {ms:.2f} ms" for s, ms in v["ms"].items()) + ")"
            for k, v in results["map_reading"].items()
        )]  # fmt: skip
    if results["skipped"]:
        skipped = "; ".join(f"n={s['length']}: {s['reason']}" for s in results["skipped"])
        out += ["", f"Skipped: {skipped}"]
    return "\n".join(out + targets_lines(results["targets"])) + "\n"


def targets_lines(t: dict) -> list[str]:
    """The goals, met or missed (`check_targets`), as a markdown section."""
    if not t:
        return []
    eff, step, sp = t["gemm_efficiency"], t["translation_vs_target_step"], t["switch_speedup"]
    mark = {True: "met", False: "**missed**"}
    per_n = ", ".join(f"{n}: {100 * v:.0f}% (maps alone {100 * eff['maps_alone'][n]:.0f}%)"
                      for n, v in eff["value"].items())  # fmt: skip
    return [
        "",
        "## Goals",
        "",
        f"- translation (the hand-off's, whole) against the same-run GEMM, at every length "
        f"(goal {eff['goal']}): {per_n}: {mark[eff['met']]}",
        f"- translation / one target decode step at n={step['at']} (goal {step['goal']}): "
        f"{step['value']:.3f} (the GEMM's own {step['gemm_floor']:.3f}): {mark[step['met']]}",
        f"- switch speed-up R/X at n={sp['at']} (goal {sp['goal']}): {sp['value']:.2f}x: "
        f"{mark[sp['met']]}",
    ]


def plot(results: dict, path: str | Path) -> Path:
    """TTFT against prefix length per path, log-log, min-max bars over trials."""
    plt = report.pyplot()
    lens = sorted(int(n) for n in results["lengths"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = {
        "target re-prefill TTFT (R)": lambda t: t["target_ttft"],
        "switch TTFT: translation + first step (X)": lambda t: t["switch_ttft"],
        "ours: source prefill + X": lambda t: np.add(t["source_prefill"], t["switch_ttft"]),
        "translation alone": lambda t: t["translate"],
        **{f"speculative prefill, {k:g} kept": lambda t, k=k: t[peer_phase(k)]
           for k in results["settings"].get("specprefill_keep") or []},
    }  # fmt: skip
    styles = ("o-", "s-", "^--", "x-.", "v:", "d:", "p:", "h:")
    for (label, fn), style in zip(curves.items(), styles):
        per = [np.asarray(fn(results["lengths"][str(n)]["trials"]), float) * 1e3 for n in lens]
        med = np.array([np.median(v) for v in per])
        err = np.array([med - [v.min() for v in per], [v.max() for v in per] - med])
        ax.errorbar(lens, med, yerr=np.maximum(err, 0), fmt=style, capsize=3, label=label)
    p = results["pair"]
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="prefix length (tokens)", ylabel="time (ms)")
    ax.set_title(f"{p['source']['name']} → {p['target']['name']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path)


def write_outputs(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """bench.json (everything, raw trials included), bench.md and ttft.png in `out_dir`."""
    return report.write(out_dir, "bench", results, markdown_report(results),
                        plot if results["lengths"] else None, figure="ttft.png")  # fmt: skip
