"""All the ways to hand a cache to another model, side by side on one pair and one data set.

Each method (`mlx_kvlingo.eval.methods`) is calibrated on the training split at several settings,
then scored on the same held-out examples with the evaluation harness's metrics (NLL, top-1
agreement with the native target, KL(native || method), gap recovered), timed on one prompt
(switch TTFT: the method's translation plus the target's first step, median of a few trials;
the source's own prefill is not counted, as in `bench`), and sized: bytes per token that
would cross a wire between two machines, and what the method stores. A method that cannot
serve the pair is listed with the reason. Output: a rich table, a JSON file and a
quality-latency Pareto plot.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.evaluate import MIN_GAP, Scores, format_kl, gap_recovered
from mlx_kvlingo.eval.methods import (
    KVLingo,
    NotApplicable,
    capture_span,
    droidspeak,
    human_bytes,
    load_method,
    prepare,
    quantized,
    raw,
    scd,
)
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.scoring import native_logp, student_logp

import mlx.core as mx
import numpy as np
from rich.progress import Progress
from rich.table import Table

SCHEMA = "mlx-kvlingo/compare"
FAMILIES = ("kvlingo", "raw", "quantized", "droidspeak", "scd")


@dataclass
class CompareConfig:
    methods: tuple[str, ...] = FAMILIES
    kvlingo_nu: tuple[int, ...] = (1, 2)
    quant_bits: tuple[int, ...] = (4, 8)
    droidspeak_layers: tuple[int, ...] = (1, 2, 4)
    droidspeak_stride: int = 1
    scd_ranks: tuple[tuple[float, float], ...] = ((0.125, 0.25), (0.25, 0.5), (1.0, 1.0))
    scd_patches: tuple[int, ...] = (1, 2)  # patched variants of the middle rank setting
    scd_steps: int = 200
    scd_hidden_rank: int | None = None
    calib_examples: int = 64
    select_examples: int = 8  # for DroidSpeak profiling and SCD patch selection
    eval_examples: int = 32
    ttft_tokens: int = 256
    ttft_trials: int = 3
    bandwidth_gbps: float = 1.0
    native_first: bool = True  # every method keeps the target's own K/V at position 0


@dataclass
class Entry:
    """One row: a method at one setting, or a family that does not apply (method None)."""

    family: str
    label: str
    method: object = None
    reason: str = ""
    calibrate_s: float = 0.0
    result: dict = field(default_factory=dict)


# -- calibration -----------------------------------------------------------------------------


def _rank(fraction: float, width: int) -> int:
    return max(1, int(round(fraction * width)))


def calibrate_all(pair, train, cfg: CompareConfig, extra=(), progress=True, log=print,
                  fit_kvlingo=None) -> list:  # fmt: skip
    """Calibrate every requested method at every setting; `extra`: (label, method) to add.

    `fit_kvlingo(pair, train, nu, native_first, progress) -> Translator` fits KV-Lingo's
    closed form (the caller passes `calibrate.fit_kvlingo`: measuring does not train).
    """
    entries: list[Entry] = [Entry("kvlingo", label, m) for label, m in extra]
    sel = train[: cfg.select_examples]

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t

    kvl = {}
    if ("kvlingo" in cfg.methods or "quantized" in cfg.methods) and fit_kvlingo is None:
        raise ValueError("comparing kvlingo (or quantized kvlingo) needs fit_kvlingo")
    if "kvlingo" in cfg.methods or "quantized" in cfg.methods:
        for nu in cfg.kvlingo_nu:
            log(f"calibrating kvlingo nu={nu} (closed form) on {len(train)} examples")
            tr, s = timed(lambda nu=nu: fit_kvlingo(pair, train, nu, cfg.native_first, progress))
            kvl[nu] = Entry("kvlingo", f"kvlingo mixing nu={nu}", KVLingo(tr, f"kvlingo nu={nu}"),
                            calibrate_s=s)  # fmt: skip
        if "kvlingo" in cfg.methods:
            entries += list(kvl.values())
    try:
        rawm = raw.calibrate(pair, native_first=cfg.native_first)
        if "raw" in cfg.methods:
            entries.append(Entry("raw", "raw", rawm))
    except NotApplicable as e:
        rawm, raw_reason = None, str(e)
        if "raw" in cfg.methods:
            entries.append(Entry("raw", "raw", reason=str(e)))
    if "quantized" in cfg.methods:
        for bits in cfg.quant_bits:
            if rawm is None:
                entries.append(
                    Entry(
                        "quantized",
                        f"raw @{bits}-bit",
                        reason=f"quantizes raw transfer: {raw_reason}",
                    )
                )
            else:
                m = quantized.Quantized(rawm, bits)
                entries.append(Entry("quantized", m.label(), m))
            if kvl:
                inner = kvl[min(kvl)]
                m = quantized.Quantized(inner.method, bits)
                entries.append(Entry("quantized", m.label(), m, calibrate_s=inner.calibrate_s))
    if "droidspeak" in cfg.methods:
        L = pair.target.geometry.layers
        sizes = [k for k in cfg.droidspeak_layers if k <= L]
        try:
            droidspeak.check(pair)
            log(f"profiling droidspeak blocks of {sizes} layers on {len(sel)} examples")
            ms, s = timed(lambda: droidspeak.calibrate(pair, sel, sizes, cfg.droidspeak_stride,
                                                       progress, cfg.native_first))  # fmt: skip
            entries += [Entry("droidspeak", m.label(), m, calibrate_s=s / len(ms)) for m in ms]
        except NotApplicable as e:
            entries.append(Entry("droidspeak", "droidspeak", reason=str(e)))
    if "scd" in cfg.methods:
        entries += _calibrate_scd(pair, train, cfg, progress, log, timed)
    return entries


def _calibrate_scd(pair, train, cfg, progress, log, timed) -> list:
    s, t = pair.source.geometry, pair.target.geometry
    wk, wv = min(s.key_width, t.key_width), min(s.value_width, t.value_width)
    ranks = [(_rank(a, wk), _rank(b, wv)) for a, b in cfg.scd_ranks]
    log(f"calibrating scd REUSE at ranks {ranks} on {len(train)} examples")
    fits, secs = timed(
        lambda: scd.fit_reuse(pair, train, ranks, progress=progress, native_first=cfg.native_first)
    )
    out = [Entry("scd", m.label(), m, calibrate_s=secs / len(fits)) for m in fits]
    if cfg.scd_patches and max(cfg.scd_patches) > 0:
        mid = fits[len(fits) // 2]
        sc = scd.ScdConfig(*mid.ranks, patches=max(cfg.scd_patches), steps=cfg.scd_steps,
                           hidden_rank=cfg.scd_hidden_rank, select_examples=cfg.select_examples)  # fmt: skip
        log(f"selecting scd patch layers (up to {sc.patches}) for ranks {mid.ranks}")
        patched, ps = timed(lambda: scd.select_patches(pair, mid, train, sc, progress))
        order = patched.meta["calibration"]["patch_selection"]["order"]
        if not order:
            log("scd: no layer improves on REUSE alone; no patched variants")
        for k in sorted(set(cfg.scd_patches)):
            if 0 < k <= len(order):
                m = patched.with_patches(order[:k])
                out.append(
                    Entry("scd", m.label(), m, calibrate_s=out[len(fits) // 2].calibrate_s + ps)
                )
    return out


# -- evaluation ------------------------------------------------------------------------------


def evaluate_all(pair, entries: list, examples, progress=True) -> dict:
    """Quality of every applicable entry on `examples`, with native and source-alone rows."""
    live = [e for e in entries if e.method is not None]
    cuts = {e.method.key_cut for e in live} or {"post_norm"}
    points = sorted({p for e in live for p in e.method.needs_hidden})
    scores = {id(e): Scores.empty() for e in live}
    native, source, weights = Scores.empty(), Scores.empty(), []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("evaluating", total=len(examples))
        for ex in examples:
            preps = {}
            for cut in sorted(cuts):
                p = prepare(pair, ex, cut, points)
                preps[cut] = p
            teacher = next(iter(preps.values())).teacher_logp
            targets = mx.array(list(ex.continuation))
            native.add(teacher, teacher, targets)
            source.add(native_logp(pair.source, ex), teacher, targets)
            for e in live:
                scores[id(e)].add(student_logp(e.method, pair, preps[e.method.key_cut]),
                                  teacher, targets)  # fmt: skip
            weights.append(len(ex.continuation))
            bar.advance(task)
    out = {"native": native.summary(weights), "source": source.summary(weights)}
    src, nat = out["source"]["nll"], out["native"]["nll"]
    out["native"]["gap_recovered"] = gap_recovered(src, nat, nat)
    out["source"]["gap_recovered"] = gap_recovered(src, nat, src)
    for e in live:
        e.result.update(scores[id(e)].summary(weights))
        e.result["gap_recovered"] = gap_recovered(src, nat, e.result["nll"])
    out["examples"], out["tokens"] = len(examples), int(sum(weights))
    return out


# -- latency ---------------------------------------------------------------------------------


def _first_token(model, last: mx.array, cache) -> None:
    logits = model(last[None], cache=cache)[:, -1, :]
    mx.eval(mx.argmax(logits, axis=-1))


def _median_time(fn, trials: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def prompt_from(examples, n: int) -> list[int]:
    """n real tokens: held-out prefixes and continuations, concatenated and cut."""
    tokens: list[int] = []
    while len(tokens) < n:
        for ex in examples:
            tokens += list(ex.prefix) + list(ex.continuation)
    return tokens[:n]


def time_all(pair, entries: list, tokens: list[int], trials: int = 3) -> dict:
    """Switch TTFT per entry (translation + the target's first step), target re-prefill TTFT
    and the source's prefill, each the median of `trials` after one warm-up."""
    live = [e for e in entries if e.method is not None]
    last = mx.array(tokens[-1:])
    spans = {}
    for cut in sorted({e.method.key_cut for e in live} or {"post_norm"}):
        points = sorted({p for e in live if e.method.key_cut == cut for p in e.method.needs_hidden})
        spans[cut] = capture_span(pair.source, tokens[:-1], cut, points)

    def reprefill():
        cache = new_cache(pair.target)
        pair.target.model(mx.array(tokens[:-1])[None], cache=cache)
        _first_token(pair.target.model, last, cache)

    def source_prefill():
        cache = new_cache(pair.source)
        pair.source.model(mx.array(tokens[:-1])[None], cache=cache)
        mx.eval([c.keys for c in cache])

    for e in live:
        span = spans[e.method.key_cut]

        def switch(m=e.method, span=span):
            cache = new_cache(pair.target)
            keys, values = m.translate(span, pair.target)
            append_kv(cache, keys, values)
            _first_token(pair.target.model, last, cache)

        e.result["switch_ttft_s"] = _median_time(switch, trials)
    return {
        "tokens": len(tokens),
        "target_reprefill_ttft_s": _median_time(reprefill, trials),
        "source_prefill_s": _median_time(source_prefill, trials),
    }


# -- the whole comparison --------------------------------------------------------------------


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (latency, loss): nothing else is as fast and as good
    with one of the two strictly better."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any(
            (xo <= x and yo <= y) and (xo < x or yo < y)
            for j, (xo, yo) in enumerate(points)
            if j != i
        ):
            front.append(i)
    return front


def run_compare(pair, train, held, cfg: CompareConfig = CompareConfig(), extra=(), entries=None,
                progress=True, log=print, fit_kvlingo=None) -> dict:  # fmt: skip
    """Calibrate (unless `entries` are given), evaluate, time; the JSON-ready result."""
    started = time.perf_counter()
    train, held = list(train)[: cfg.calib_examples], list(held)[: cfg.eval_examples]
    if entries is None:
        entries = calibrate_all(pair, train, cfg, extra, progress, log, fit_kvlingo)
    log(f"evaluating {sum(e.method is not None for e in entries)} settings on {len(held)} "
        f"held-out examples")  # fmt: skip
    quality = evaluate_all(pair, entries, held, progress)
    log(f"timing switch TTFT at {cfg.ttft_tokens} tokens")
    timing = time_all(pair, entries, prompt_from(held, cfg.ttft_tokens), cfg.ttft_trials)
    bw = cfg.bandwidth_gbps * 1e9 / 8  # bytes per second
    n = timing["tokens"] - 1
    rows = []
    for e in entries:
        row = {"family": e.family, "label": e.label}
        if e.method is None:
            row["not_applicable"] = e.reason
        else:
            m = e.method
            row |= e.result
            row |= {
                "wire_bytes_per_token": m.wire_bytes_per_token(),
                "translator_bytes": m.nbytes(),
                "calibrate_s": e.calibrate_s,
            }
            row["ttft_with_wire_s"] = row["switch_ttft_s"] + n * row["wire_bytes_per_token"] / bw
            if hasattr(m, "code_size_per_token"):
                row["code_size_per_token"] = m.code_size_per_token()
        rows.append(row)
    nat = {"family": "reference", "label": "native (target re-prefill)", **quality["native"],
           "switch_ttft_s": timing["target_reprefill_ttft_s"], "wire_bytes_per_token": 4,
           "translator_bytes": 0}  # fmt: skip
    nat["ttft_with_wire_s"] = nat["switch_ttft_s"] + n * 4 / bw
    src = {"family": "reference", "label": "source alone", **quality["source"]}
    live = [r for r in rows if "kl_native" in r] + [nat]
    for key, name in (("switch_ttft_s", "pareto"), ("ttft_with_wire_s", "pareto_with_wire")):
        for i in pareto_front([(r[key], r["kl_native"]) for r in live]):
            live[i][name] = True
    return {
        "schema": SCHEMA,
        "pair": {"source": pair.source.name, "target": pair.target.name},
        "config": asdict(cfg),
        "examples": quality["examples"], "tokens": quality["tokens"],
        "timing": timing,
        "rows": [nat, src] + rows,
        "elapsed_s": time.perf_counter() - started,
    }  # fmt: skip


# -- a same-geometry pair -----------------------------------------------------------------------


def perturbed_copy(
    folder: str | Path, scale: float, seed: int = 0, out: str | Path | None = None
) -> Path:
    """A copy of a local model folder whose transformer-layer matrices get Gaussian noise of
    `scale` times each matrix's own standard deviation (embeddings, head and norms unchanged):
    a stand-in for a fine-tune, with the same geometry. Written once, then reused."""
    import shutil

    from mlx_kvlingo.models.demo.smollm2 import cache_root

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: not a local model folder")
    out = (
        Path(out)
        if out
        else cache_root() / "perturbed" / f"{folder.name}-noise{scale:g}-seed{seed}"
    )
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        weights = mx.load(str(f))
        for k in sorted(weights):
            v = weights[k]
            if ".layers." in k and v.ndim == 2 and mx.issubdtype(v.dtype, mx.floating):
                noise = mx.random.normal(v.shape) * (scale * v.astype(mx.float32).std())
                weights[k] = (v.astype(mx.float32) + noise).astype(v.dtype)
        mx.save_safetensors(str(tmp / f.name), weights, metadata={"format": "mlx"})
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
    (tmp / "perturbation.json").write_text(json.dumps(
        {"from": str(folder), "scale": scale, "seed": seed,
         "what": "N(0, (scale * std(W))^2) added to every 2-D weight under model.layers"}))  # fmt: skip
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


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


def save_methods(entries: list, folder: str | Path, pair=None) -> Path:
    """Each calibrated method in its own file plus `manifest.json` (label -> file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"rows": []}
    for i, e in enumerate(entries):
        row = {"family": e.family, "label": e.label, "calibrate_s": e.calibrate_s}
        if e.method is None:
            row["not_applicable"] = e.reason
        else:
            name = f"{i:02d}-{e.family}.safetensors"
            e.method.save(folder / name, pair)
            row["file"] = name
        manifest["rows"].append(row)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


def load_methods(folder: str | Path, pair=None) -> list:
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    out = []
    for row in manifest["rows"]:
        if "file" in row:
            m = load_method(folder / row["file"], pair)
            if isinstance(m, KVLingo):
                m._label = row["label"]
            out.append(Entry(row["family"], row["label"], m, calibrate_s=row["calibrate_s"]))
        else:
            out.append(Entry(row["family"], row["label"], reason=row["not_applicable"]))
    return out


__all__ = ["CompareConfig", "Entry", "calibrate_all", "evaluate_all", "plot", "run_compare",
           "save_methods", "load_methods", "table", "time_all"]  # fmt: skip
