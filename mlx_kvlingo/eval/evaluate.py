"""The target's scores on held-out continuations given its own cache of the prefix (native), the
translated one, the source's as is (raw: identical geometries only) and the source alone: NLL,
top-1, agreement with native, KL(native || x) and gap recovered
= (NLL_source - NLL_x) / (NLL_source - NLL_native).
"""

from __future__ import annotations

from mlx_kvlingo.eval.report import number
from mlx_kvlingo.kv.scoring import kl, native_logp, prepare, student_logp
from mlx_kvlingo.kv.translator import Side, TranslatorConfig, identity_translator

import mlx.core as mx
import numpy as np
from rich.table import Table

CONDITIONS = ("native", "translated", "raw", "source")
#: nats: a smaller gap between the source alone and the native target is reported as n/a
MIN_GAP = 0.01


def gap_recovered(nll_source: float, nll_native: float, nll: float) -> float:
    """(NLL_source - NLL) / (NLL_source - NLL_native); NaN when the gap is under MIN_GAP."""
    gap = nll_source - nll_native
    return (nll_source - nll) / gap if abs(gap) >= MIN_GAP else float("nan")


def format_kl(x: float) -> str:
    """KL is never negative: float error below zero prints as 0.0000, not -0.0000."""
    return f"{x if x > 0 else 0.0:.4f}"


def scores(logp: mx.array, native: mx.array, targets: mx.array) -> dict:
    """One example's NLL and top-1 on `targets`, top-1 agreement with `native`, KL(native || x)."""
    agree = (logp.argmax(-1) == native.argmax(-1)).astype(mx.float32).mean()
    return {
        "nll": float(-mx.take_along_axis(logp, targets[:, None], axis=-1).mean()),
        "top1": float((logp.argmax(-1) == targets).astype(mx.float32).mean()),
        "agree_native": float(agree),
        "kl_native": float(kl(native, logp)),
    }


def raw_transfer(pair):
    """The source's cache as it is (the identity translator), or the reason it cannot serve."""
    s, t = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    if s != t:
        return (
            "raw transfer needs identical KV geometry (layers x KV heads x head dim: "
            f"{s.layers}x{s.kv_heads}x{s.head_dim} vs {t.layers}x{t.kv_heads}x{t.head_dim})"
        )
    rows = tuple((i,) for i in range(t.layers))
    return identity_translator(TranslatorConfig("mixing", s, t, rows, rows))


def evaluate(pair, translator, examples, progress=None) -> dict:
    """Every condition's token-weighted scores on `examples` (JSON-ready); `progress(done, total)`
    after each example."""
    translators = {"translated": translator}
    raw = raw_transfer(pair)
    if not isinstance(raw, str):
        translators["raw"] = raw
    cuts = sorted({tr.config.key_cut for tr in translators.values()})
    rows: dict = {label: [] for label in ("native", *translators, "source")}
    for i, ex in enumerate(examples):
        preps = {cut: prepare(pair, ex, cut) for cut in cuts}
        teacher = preps[cuts[0]].teacher_logp
        targets = mx.array(list(ex.continuation))
        rows["native"].append(scores(teacher, teacher, targets))
        for label, tr in translators.items():
            logp = student_logp(tr, pair, preps[tr.config.key_cut])
            rows[label].append(scores(logp, teacher, targets))
        rows["source"].append(scores(native_logp(pair.source, ex), teacher, targets))
        if progress:
            progress(i + 1, len(examples))
    w = np.array([len(ex.continuation) for ex in examples], dtype=np.float64)
    metrics = ("nll", "top1", "agree_native", "kl_native")
    out = {  # token-weighted means
        label: {k: float(np.dot([r[k] for r in rs], w) / w.sum()) for k in metrics}
        for label, rs in rows.items()
    }
    src, nat = out["source"]["nll"], out["native"]["nll"]
    for r in out.values():
        r["gap_recovered"] = gap_recovered(src, nat, r["nll"])
    if isinstance(raw, str):
        out["raw"] = {"skipped": raw}
    return {**out, "examples": len(examples), "tokens": int(w.sum()),
            "pair": {"source": pair.source.name, "target": pair.target.name}}  # fmt: skip


def table(result: dict, title: str = "evaluation") -> Table:
    t = Table("condition", "NLL", "ppl", "top-1", "agree", "KL", "gap rec.",
              title=f"{title} ({result['examples']} examples, {result['tokens']} tokens)",
              caption="top-1: accuracy on the real tokens · agree: top-1 equal to the native target's"
                      " · KL(native || condition) · gap rec. = (NLL_source - NLL) / (NLL_source - NLL_native),"
                      f" n/a when that gap is under {MIN_GAP} nats")  # fmt: skip
    for c in CONDITIONS:
        r = result[c]
        if "skipped" in r:
            t.add_row(c, *["n/a"] * 6)
            t.caption += f" · {c}: n/a, {r['skipped']}"
        else:
            t.add_row(
                c, f"{r['nll']:.3f}", f"{np.exp(r['nll']):.1f}", f"{r['top1']:.3f}", f"{r['agree_native']:.3f}",
                format_kl(r["kl_native"]), number(r["gap_recovered"], ".3f"),
            )  # fmt: skip
    return t
