"""All the ways to hand a cache to another model, side by side on one pair and one data set.

Each method (`mlx_kvlingo.eval.methods`) is calibrated on the training split at several settings,
then scored on the same held-out examples with the evaluation harness's metrics (NLL, top-1
agreement with the native target, KL(native || method), gap recovered: `score_methods`), timed
on one prompt (switch TTFT: the method's translation plus the target's first step, median of a
few trials; the source's own prefill is not counted, as in `bench`), and sized: bytes per token
that would cross a wire between two machines, and what the method stores. Every method keeps
the target's own K/V at position 0 (the attention sink, as KV-Lingo translators do). A method
that cannot serve the pair is listed with the reason. Output: a rich table, a JSON file and a
quality-latency Pareto plot.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.bench import first_token
from mlx_kvlingo.eval.evaluate import MIN_GAP, format_kl, score_methods
from mlx_kvlingo.eval.methods import (
    KVLingo,
    NotApplicable,
    capture_span,
    droidspeak,
    human_bytes,
    quantized,
    raw,
    scd,
)
from mlx_kvlingo.kv.cache import append_kv, new_cache

import mlx.core as mx
import numpy as np
from rich.table import Table

SCHEMA = "mlx-kvlingo/compare"
FAMILIES = ("kvlingo", "raw", "quantized", "droidspeak", "scd")
NATIVE_FIRST = True  # every method keeps the target's own K/V at position 0
SELECT_EXAMPLES = 8  # training examples DroidSpeak profiles its blocks on


@dataclass
class CompareConfig:
    methods: tuple[str, ...] = FAMILIES
    kvlingo_nu: tuple[int, ...] = (1, 2)
    quant_bits: tuple[int, ...] = (4, 8)
    droidspeak_layers: tuple[int, ...] = (1, 2, 4)
    scd_ranks: tuple[tuple[float, float], ...] = ((0.125, 0.25), (0.25, 0.5), (1.0, 1.0))
    calib_examples: int = 64
    eval_examples: int = 32
    ttft_tokens: int = 256
    ttft_trials: int = 3
    bandwidth_gbps: float = 1.0


@dataclass
class Entry:
    """One row: a method at one setting, or a family that does not apply (method None)."""

    family: str
    label: str
    method: object = None
    reason: str = ""
    calibrate_s: float = 0.0
    result: dict = field(default_factory=dict)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def calibrate_all(pair, train, cfg: CompareConfig, extra=(), progress=True, log=print,
                  fit_kvlingo=None) -> list:  # fmt: skip
    """Calibrate every requested method at every setting; `extra`: (label, method) to add.

    `fit_kvlingo(pair, train, nu, native_first, progress) -> Translator` fits KV-Lingo's
    closed form (the caller passes `calibrate.fit_kvlingo`: measuring does not train).
    """
    entries: list[Entry] = [Entry("kvlingo", label, m) for label, m in extra]
    kvl = []
    if {"kvlingo", "quantized"} & set(cfg.methods):
        if fit_kvlingo is None:
            raise ValueError("comparing kvlingo (or quantized kvlingo) needs fit_kvlingo")
        for nu in cfg.kvlingo_nu:
            log(f"calibrating kvlingo nu={nu} (closed form) on {len(train)} examples")
            tr, s = _timed(lambda nu=nu: fit_kvlingo(pair, train, nu, NATIVE_FIRST, progress))
            kvl.append(Entry("kvlingo", f"kvlingo mixing nu={nu}",
                             KVLingo(tr, f"kvlingo nu={nu}"), calibrate_s=s))  # fmt: skip
        entries += kvl if "kvlingo" in cfg.methods else []
    try:
        rawm, why = raw.RawTransfer.for_pair(pair, NATIVE_FIRST), ""
    except NotApplicable as e:
        rawm, why = None, str(e)
    if "raw" in cfg.methods:
        entries.append(Entry("raw", "raw", rawm, reason=why))
    if "quantized" in cfg.methods:
        for bits in cfg.quant_bits:
            if rawm is None:
                entries.append(Entry("quantized", f"raw @{bits}-bit",
                                     reason=f"quantizes raw transfer: {why}"))  # fmt: skip
            else:
                m = quantized.Quantized(rawm, bits)
                entries.append(Entry("quantized", m.label(), m))
            if kvl:
                m = quantized.Quantized(kvl[0].method, bits)
                entries.append(Entry("quantized", m.label(), m, calibrate_s=kvl[0].calibrate_s))
    if "droidspeak" in cfg.methods:
        sizes = [k for k in cfg.droidspeak_layers if k <= pair.target.geometry.layers]
        sel = train[:SELECT_EXAMPLES]
        try:
            droidspeak.check(pair)
            log(f"profiling droidspeak blocks of {sizes} layers on {len(sel)} examples")
            ms, s = _timed(lambda: droidspeak.calibrate(pair, sel, sizes, progress=progress,
                                                        native_first=NATIVE_FIRST))  # fmt: skip
            entries += [Entry("droidspeak", m.label(), m, calibrate_s=s / len(ms)) for m in ms]
        except NotApplicable as e:
            entries.append(Entry("droidspeak", "droidspeak", reason=str(e)))
    if "scd" in cfg.methods:
        s, t = pair.source.geometry, pair.target.geometry
        wk, wv = min(s.key_width, t.key_width), min(s.value_width, t.value_width)
        ranks = [(max(1, round(a * wk)), max(1, round(b * wv))) for a, b in cfg.scd_ranks]
        log(f"calibrating scd at ranks {ranks} on {len(train)} examples")
        fits, secs = _timed(lambda: scd.fit_reuse(pair, train, ranks, progress=progress,
                                                  native_first=NATIVE_FIRST))  # fmt: skip
        entries += [Entry("scd", m.label(), m, calibrate_s=secs / len(fits)) for m in fits]
    return entries


def time_all(pair, entries: list, tokens: list[int], trials: int = 3) -> dict:
    """Switch TTFT per entry (translation + the target's first step), target re-prefill TTFT
    and the source's prefill, each the median of `trials` after one warm-up."""
    live = [e for e in entries if e.method is not None]
    last = mx.array(tokens[-1:])
    spans = {}
    for cut in sorted({e.method.key_cut for e in live} or {"post_norm"}):
        points = sorted({p for e in live if e.method.key_cut == cut for p in e.method.needs_hidden})
        spans[cut] = capture_span(pair.source, tokens[:-1], cut, points)

    def median_time(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    def prefill(model):
        cache = new_cache(model)
        model.model(mx.array(tokens[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def switch(m, span):
        cache = new_cache(pair.target)
        append_kv(cache, *m.translate(span, pair.target))
        first_token(pair.target.model, last, cache)

    for e in live:
        e.result["switch_ttft_s"] = median_time(lambda m=e.method: switch(m, spans[m.key_cut]))
    return {
        "tokens": len(tokens),
        "target_reprefill_ttft_s": median_time(
            lambda: first_token(pair.target.model, last, prefill(pair.target))
        ),
        "source_prefill_s": median_time(lambda: prefill(pair.source)),
    }


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (latency, loss): nothing else is as fast and as good
    with one of the two strictly better."""
    return [i for i, (x, y) in enumerate(points)
            if not any(xo <= x and yo <= y and (xo < x or yo < y)
                       for j, (xo, yo) in enumerate(points) if j != i)]  # fmt: skip


def prompt_from(examples, n: int) -> list[int]:
    """n real tokens: held-out prefixes and continuations, concatenated and cut."""
    tokens: list[int] = []
    while len(tokens) < n:
        for ex in examples:
            tokens += list(ex.prefix) + list(ex.continuation)
    return tokens[:n]


def run_compare(pair, train, held, cfg: CompareConfig = CompareConfig(), extra=(), entries=None,
                progress=True, log=print, fit_kvlingo=None) -> dict:  # fmt: skip
    """Calibrate (unless `entries` are given), evaluate, time; the JSON-ready result."""
    started = time.perf_counter()
    train, held = list(train)[: cfg.calib_examples], list(held)[: cfg.eval_examples]
    if entries is None:
        entries = calibrate_all(pair, train, cfg, extra, progress, log, fit_kvlingo)
    live = [e for e in entries if e.method is not None]
    log(f"evaluating {len(live)} settings on {len(held)} held-out examples")
    quality = score_methods(pair, {i: e.method for i, e in enumerate(live)}, held, progress)
    for i, e in enumerate(live):
        e.result.update(quality[i])
    log(f"timing switch TTFT at {cfg.ttft_tokens} tokens")
    timing = time_all(pair, entries, prompt_from(held, cfg.ttft_tokens), cfg.ttft_trials)
    wire_s = (timing["tokens"] - 1) / (cfg.bandwidth_gbps * 1e9 / 8)  # per byte per token
    rows = []
    for e in entries:
        row = {"family": e.family, "label": e.label}
        if e.method is None:
            row["not_applicable"] = e.reason
        else:
            m = e.method
            row |= e.result | {"wire_bytes_per_token": m.wire_bytes_per_token(),
                               "translator_bytes": m.nbytes(), "calibrate_s": e.calibrate_s}  # fmt: skip
            row["ttft_with_wire_s"] = row["switch_ttft_s"] + wire_s * row["wire_bytes_per_token"]
            if hasattr(m, "code_size_per_token"):
                row["code_size_per_token"] = m.code_size_per_token()
        rows.append(row)
    nat = {"family": "reference", "label": "native (target re-prefill)", **quality["native"],
           "switch_ttft_s": timing["target_reprefill_ttft_s"], "wire_bytes_per_token": 4,
           "translator_bytes": 0}  # fmt: skip
    nat["ttft_with_wire_s"] = nat["switch_ttft_s"] + wire_s * 4
    src = {"family": "reference", "label": "source alone", **quality["source"]}
    scored = [r for r in rows if "kl_native" in r] + [nat]
    for key, name in (("switch_ttft_s", "pareto"), ("ttft_with_wire_s", "pareto_with_wire")):
        for i in pareto_front([(r[key], r["kl_native"]) for r in scored]):
            scored[i][name] = True
    return {
        "schema": SCHEMA,
        "pair": {"source": pair.source.name, "target": pair.target.name},
        "config": asdict(cfg),
        "examples": quality["examples"], "tokens": quality["tokens"],
        "timing": timing,
        "rows": [nat, src] + rows,
        "elapsed_s": time.perf_counter() - started,
    }  # fmt: skip


# -- output ----------------------------------------------------------------------------------


def _ms(s) -> str:
    return "" if s is None else f"{1e3 * s:.1f}"


def _num(x: float, fmt: str) -> str:
    return "–" if x is None or np.isnan(x) else format(x, fmt)


def table(result: dict) -> Table:
    cfg, t = result["config"], result["timing"]
    title = (f"{result['pair']['source']} -> {result['pair']['target']}: {result['examples']} "
             f"held-out examples, {result['tokens']} tokens")  # fmt: skip
    caption = (
        "KL(native || method) and agree (top-1 equal to the native target's) on the "
        "continuation; gap rec. = (NLL_source - NLL) / (NLL_source - NLL_native), – where "
        f"the two differ by less than {MIN_GAP} nats; "
        f"TTFT: translation + first target step at {t['tokens']} tokens, median of "
        f"{cfg['ttft_trials']} (source prefill, {_ms(t['source_prefill_s'])} ms, not counted); "
        f"+wire: plus sending {t['tokens'] - 1} tokens' bytes at {cfg['bandwidth_gbps']:g} Gb/s; "
        "bytes/tok at float16 (quantized: b bits + fp16 scale/bias per group); "
        "* = on the quality-latency Pareto front (with wire)"
    )
    tab = Table("method", "NLL", "agree", "KL", "gap rec.", "TTFT ms", "+wire ms", "bytes/tok",
                "size", "calib s", title=title, caption=caption)  # fmt: skip
    for r in result["rows"]:
        if "not_applicable" in r:
            tab.add_row(r["label"], "n/a", *[""] * 8)
            tab.caption += f" · {r['label']}: n/a, {r['not_applicable']}"
            continue
        star = " *" if r.get("pareto_with_wire") else ""
        tab.add_row(
            r["label"] + star, f"{r['nll']:.3f}", f"{r['agree_native']:.3f}",
            format_kl(r["kl_native"]), _num(r["gap_recovered"], ".3f"), _ms(r.get("switch_ttft_s")),
            _ms(r.get("ttft_with_wire_s")),
            "" if "wire_bytes_per_token" not in r else f"{r['wire_bytes_per_token']:.0f}",
            "" if "translator_bytes" not in r else human_bytes(r["translator_bytes"]),
            "" if "calibrate_s" not in r else f"{r['calibrate_s']:.1f}",
        )  # fmt: skip
    return tab


def plot(result: dict, path: str | Path) -> Path:
    """Quality (KL to native, log) against switch TTFT, without and with the wire transfer."""
    plt = report.pyplot()
    rows = [r for r in result["rows"] if "kl_native" in r and "switch_ttft_s" in r]
    methods = [r for r in rows if r["family"] != "reference"]
    native = next(r for r in rows if r["family"] == "reference")
    fams = sorted({r["family"] for r in methods})
    colors = dict(zip(fams, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    floor = max(min([r["kl_native"] for r in methods if r["kl_native"] > 0] or [1e-6]) / 10, 1e-9)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, key, front, title in (
        (axes[0], "switch_ttft_s", "pareto", "compute only"),
        (axes[1], "ttft_with_wire_s", "pareto_with_wire",
         f"with the transfer at {result['config']['bandwidth_gbps']:g} Gb/s"),
    ):  # fmt: skip
        for f in fams:
            pts = [r for r in methods if r["family"] == f]
            ax.scatter([1e3 * r[key] for r in pts], [max(r["kl_native"], floor) for r in pts],
                       label=f, color=colors[f], s=40, zorder=3)  # fmt: skip
            for r in pts:
                ax.annotate(r["label"].removeprefix(f).strip() or f, (1e3 * r[key],
                            max(r["kl_native"], floor)), fontsize=7, xytext=(4, 3),
                            textcoords="offset points")  # fmt: skip
        fr = sorted((1e3 * r[key], max(r["kl_native"], floor)) for r in methods if r.get(front))
        if fr:
            ax.step(*zip(*fr), where="post", color="gray", lw=1, ls="--", zorder=2,
                    label="Pareto front")  # fmt: skip
        ax.axvline(1e3 * native[key], color="black", lw=1, ls=":",
                   label="native re-prefill (KL 0)")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("TTFT after the switch (ms)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("KL(native || method), nats/token")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(result['pair']['source']).name} -> {Path(result['pair']['target']).name} "
                 f"({result['timing']['tokens']}-token prompt)", fontsize=11)  # fmt: skip
    return report.save_figure(fig, path)


__all__ = ["CompareConfig", "Entry", "calibrate_all", "plot", "run_compare", "table", "time_all"]
