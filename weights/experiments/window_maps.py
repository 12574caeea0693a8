"""Experiment: do maps that read neighbouring tokens carry content that per-token maps lose?

Today's maps translate token t from the source's K/V at token t alone. The content
diagnosis (weights/QUALITY.md, "Content") found that what the target's deep layers add to a
token from its context is what gets lost. This fits, by ridge regression on ordinary text,
maps that read a window of the source's tokens: y_t = sum_{o in window} x_{t+o} W_o
(o = -1: the previous token, +1: the next one; the whole span is read before it is
translated, so a later token is known too). The same fit with window {0} is the control,
so the window is the only difference. Each fit is scored by the content benchmark
(facts and copies at 128 tokens against the target's own native answers) and by its
relative K/V error on held-out text.

    OPENBLAS_NUM_THREADS=1 python weights/experiments/window_maps.py --tokens 30000 \\
        --windows "0;-1,0;-1,0,1;-2,-1,0,1" --per-kind 6 --out /tmp/window_maps.json
"""

from __future__ import annotations

import argparse
import json
import time

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.content_data import shipped_texts
from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import evaluate_content, summarize
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import capture_from_cache, prefill
from mlx_kvlingo.kv.rope import rotate
from mlx_kvlingo.kv.translator import nearest_layer_map, with_native_first
from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo

import mlx.core as mx
import numpy as np


def spans(pair, texts, total: int, length: int = 256):
    """(source K/V, target K/V) RoPE-free, per text chunk of `length` tokens, up to `total`."""
    got = 0
    for text in texts:
        ids = pair.tokenizer.encode(text)[:length]
        if len(ids) < 32:
            continue
        src = prefill(pair.source, ids, new_cache(pair.source), cut="post_norm")
        cache = new_cache(pair.target)
        pair.target.model(mx.array(ids)[None], cache=cache)
        tgt = capture_from_cache(pair.target, cache, 0, len(ids))
        mx.eval(src.keys, src.values, tgt.keys, tgt.values)
        yield src, tgt
        got += len(ids)
        if got >= total:
            return


def shifted(x: np.ndarray, window) -> np.ndarray:
    """x (T, F) -> (T, F * len(window)): row t holds x[t + o] for o in window (zeros outside)."""
    T = x.shape[0]
    cols = []
    for o in window:
        y = np.zeros_like(x)
        if o <= 0:
            y[-o:] = x[: T + o] if o else x
        else:
            y[: T - o] = x[o:]
        cols.append(y)
    return np.concatenate(cols, axis=1)


def features(kv: mx.array, layers, window) -> np.ndarray:
    """kv (L, 1, H, T, D) -> per token the window of the listed layers' heads side by side."""
    x = np.concatenate(
        [np.array(kv[s, 0]).transpose(1, 0, 2).reshape(kv.shape[3], -1) for s in layers], axis=1
    )
    return np.concatenate([shifted(x, window), np.ones((x.shape[0], 1), x.dtype)], axis=1)


def targets(kv: mx.array, t: int) -> np.ndarray:
    return np.array(kv[t, 0]).transpose(1, 0, 2).reshape(kv.shape[3], -1)


class WindowMaps:
    """A content-benchmark method: per target layer, keys and values from a token window."""

    key_cut = "post_norm"

    def __init__(self, rows, window, weights, heads, first_native=True):
        self.rows, self.window, self.weights, self.heads = rows, window, weights, heads
        self.first_native = first_native

    def translate(self, span, target):
        out = {}
        for kind, kv in (("key", span.keys), ("value", span.values)):
            ys = []
            for t, w in enumerate(self.weights[kind]):
                y = features(kv, self.rows[t], self.window) @ w  # (T, H*D)
                ys.append(y.reshape(y.shape[0], self.heads, -1).transpose(1, 0, 2)[None])
            out[kind] = mx.array(np.stack(ys).astype(np.float32))
        keys, values = out["key"], out["value"]
        Lt, B, H, T, D = keys.shape
        keys = rotate(target.rope, keys.reshape(Lt * B, H, T, D), span.start).reshape(keys.shape)
        if self.first_native and span.start == 0 and span.tokens:
            keys, values = with_native_first(target, span.tokens[0], keys, values)
        return list(keys), list(values)


def fit(data, rows, window, alpha: float):
    """Ridge maps per target layer and kind from the accumulated normal equations (target
    layers reading the same source layers share X^T X)."""
    groups: dict[tuple, list[int]] = {}
    for t, r in enumerate(rows):
        groups.setdefault(tuple(r), []).append(t)
    weights = {"key": [None] * len(rows), "value": [None] * len(rows)}
    for kind in ("key", "value"):
        for r, ts in groups.items():
            xtx, xty = None, {t: None for t in ts}
            for src, tgt in data:
                x = features(src.keys if kind == "key" else src.values, r, window)
                x = x.astype(np.float64)
                xtx = x.T @ x if xtx is None else xtx + x.T @ x
                for t in ts:
                    y = targets(tgt.keys if kind == "key" else tgt.values, t).astype(np.float64)
                    xty[t] = x.T @ y if xty[t] is None else xty[t] + x.T @ y
            reg = alpha * np.trace(xtx) / xtx.shape[0] * np.eye(xtx.shape[0])
            reg[-1, -1] = 0.0  # no penalty on the bias
            for t in ts:
                weights[kind][t] = np.linalg.solve(xtx + reg, xty[t]).astype(np.float32)
    return weights


def rel_error(data, rows, window, weights) -> dict:
    out = {}
    for kind in ("key", "value"):
        num = den = 0.0
        for src, tgt in data:
            for t in range(len(rows)):
                x = features(src.keys if kind == "key" else src.values, rows[t], window)
                y = targets(tgt.keys if kind == "key" else tgt.values, t)
                num += float(((x @ weights[kind][t] - y) ** 2).sum())
                den += float((y**2).sum())
        out[kind] = (num / den) ** 0.5
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=30000, help="fitting tokens")
    ap.add_argument("--heldout-tokens", type=int, default=4000)
    ap.add_argument("--windows", default="0;-1,0;-1,0,1", help="windows, ;-separated")
    ap.add_argument("--nu", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=1e-3)
    ap.add_argument("--per-kind", type=int, default=6)
    ap.add_argument("--lengths", default="128")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="window_maps.json")
    a = ap.parse_args(argv)
    pair, default = load_demo()
    s, g = pair.source.geometry, pair.target.geometry
    rows = nearest_layer_map(s.layers, g.layers, a.nu)
    texts = shipped_texts()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(texts))
    t0 = time.perf_counter()
    data = list(spans(pair, [texts[i] for i in order[200:]], a.tokens))
    held = list(spans(pair, [texts[i] for i in order[:200]], a.heldout_tokens))
    print(f"captured {sum(x[0].length for x in data)} + {sum(x[0].length for x in held)} "
          f"tokens in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    content = [t for p in demo_content_texts() for t in read_texts(p)]
    tasks = build_tasks(pair.tokenizer, content, [int(x) for x in a.lengths.split(",")],
                        a.per_kind, kinds=("fact", "copy"), seed=a.seed)  # fmt: skip
    methods = {"default": default}
    report = {"args": vars(a), "fits": {}}
    for spec in a.windows.split(";"):
        window = tuple(int(o) for o in spec.split(","))
        t0 = time.perf_counter()
        w = fit(data, rows, window, a.alpha)
        err = rel_error(held, rows, window, w)
        label = f"window {spec}"
        methods[label] = WindowMaps(rows, window, w, g.kv_heads)
        report["fits"][label] = {"heldout_rel_error": err, "fit_s": time.perf_counter() - t0}
        print(f"{label}: held-out rel. error K {err['key']:.3f} V {err['value']:.3f}", flush=True)
    res = evaluate_content(pair, tasks, methods, small=False)
    for label in methods:
        for kind in ("fact", "copy"):
            native = [r for r in res.records if r["condition"] == "native" and r["kind"] == kind]
            mine = [r for r in res.records if r["condition"] == label and r["kind"] == kind]
            cells = summarize(mine, native)
            report["fits"].setdefault(label, {}).setdefault("content", {})[kind] = cells
            print(f"{label} {kind}: retained {cells['retained']:.2f} "
                  f"(native right {cells['native_right']}/{cells['n']}), recall "
                  f"{cells['recall']:.2f}", flush=True)  # fmt: skip
    report["records"] = res.records
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
