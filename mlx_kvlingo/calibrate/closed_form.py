"""Stage 1: per target layer and for K and V, ridge least squares from source features to the
target's native features, from streaming normal equations in float64 (memory does not grow
with the number of tokens).

Inputs are the `nu` source layers of the layer map, concatenated per token. Head-wise maps are
solved per head from the corresponding blocks of the same normal equations. With no layer map
and nu > 1, source layers are chosen per target layer by the best single-layer fit (lowest
held-in residual of a one-layer ridge map), among a window of candidates around the
nearest-by-depth layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from rich.progress import Progress

from ..translator import Side, Translator, TranslatorConfig, nearest_layer_map
from .features import layer_features, trace

KINDS = ("key", "value")


@dataclass
class Stage1Config:
    variant: str = "mixing"
    nu: int = 1
    key_cut: str = "post_norm"
    bias: bool = True  # centering + bias
    alpha: float = 1e-3  # ridge, relative to the mean input variance
    key_layers: list[list[int]] | None = None
    value_layers: list[list[int]] | None = None
    window: int = 4  # candidate source layers each side of the nearest, for nu > 1 selection
    selection_examples: int | None = None  # examples used to pick layers (None: all)
    report: dict = field(default_factory=dict)


class Moments:
    """Running sums for one least-squares problem: X^T X, X^T Y, sums, Y^T Y trace, count."""

    def __init__(self, d_in: int, d_out: int):
        self.xtx = np.zeros((d_in, d_in))
        self.xty = np.zeros((d_in, d_out))
        self.sx = np.zeros(d_in)
        self.sy = np.zeros(d_out)
        self.yy = 0.0
        self.n = 0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        x = x.astype(np.float64)
        y = y.astype(np.float64)
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.yy += float((y * y).sum())
        self.n += len(x)


def ridge(xtx, xty, sx, sy, n, alpha: float, center: bool):
    """Solve min ||X W + b - Y||^2 + lam ||W||^2 with lam = alpha * mean diag of the covariance."""
    if center:
        mx_, my = sx / n, sy / n
        cxx = xtx - n * np.outer(mx_, mx_)
        cxy = xty - n * np.outer(mx_, my)
    else:
        cxx, cxy = xtx, xty
    lam = alpha * max(np.trace(cxx) / len(cxx), 1e-12)
    w = np.linalg.solve(cxx + lam * np.eye(len(cxx)), cxy)
    b = (my - mx_ @ w) if center else np.zeros(w.shape[1])
    return w, b


def residual(xtx, xty, sx, sy, yy, n, w, b) -> float:
    """||X W + 1 b - Y||^2 from the moments alone."""
    return float(
        yy
        - 2 * np.sum(w * xty)
        - 2 * b @ sy
        + np.sum(w * (xtx @ w))
        + 2 * b @ (w.T @ sx)
        + n * b @ b
    )


def _select_layers(pair, examples, cfg: Stage1Config, kind: str) -> list[list[int]]:
    """Pick nu source layers per target layer by single-layer ridge fit quality."""
    Ls, Lt = pair.source.geometry.layers, pair.target.geometry.layers
    if cfg.nu == 1:
        return nearest_layer_map(Ls, Lt, 1)
    nearest = [r[0] for r in nearest_layer_map(Ls, Lt, 1)]
    cands = [list(range(max(0, c - cfg.window), min(Ls, c + cfg.window + 1))) for c in nearest]
    used = sorted({s for c in cands for s in c})
    grams = {s: None for s in used}
    cross: dict[tuple[int, int], np.ndarray] = {}
    sums_x = {s: 0.0 for s in used}
    sums_y = [0.0] * Lt
    yy = [0.0] * Lt
    n = 0
    for ex in examples[: cfg.selection_examples]:
        tokens = ex.prefix + ex.continuation
        xs = layer_features(trace(pair.source, tokens, cfg.key_cut), kind).astype(np.float64)
        ys = layer_features(trace(pair.target, tokens, cfg.key_cut), kind).astype(np.float64)
        for s in used:
            g = xs[s].T @ xs[s]
            grams[s] = g if grams[s] is None else grams[s] + g
            sums_x[s] = sums_x[s] + xs[s].sum(0)
        for t in range(Lt):
            sums_y[t] = sums_y[t] + ys[t].sum(0)
            yy[t] += float((ys[t] ** 2).sum())
            for s in cands[t]:
                c = xs[s].T @ ys[t]
                cross[s, t] = cross[s, t] + c if (s, t) in cross else c
        n += xs.shape[1]
    rows = []
    for t in range(Lt):
        scores = []
        for s in cands[t]:
            w, b = ridge(grams[s], cross[s, t], sums_x[s], sums_y[t], n, cfg.alpha, cfg.bias)
            scores.append(
                (residual(grams[s], cross[s, t], sums_x[s], sums_y[t], yy[t], n, w, b), s)
            )
        rows.append(sorted(s for _, s in sorted(scores)[: cfg.nu]))
    return rows


def fit_closed_form(
    pair, examples, cfg: Stage1Config = Stage1Config(), progress=True
) -> Translator:
    """Fit a translator for `pair` on `examples` (calibrate.data.Example) in one streaming pass."""
    src, tgt = pair.source.geometry, pair.target.geometry
    maps = {}
    for kind, given in (("key", cfg.key_layers), ("value", cfg.value_layers)):
        maps[kind] = given if given is not None else _select_layers(pair, examples, cfg, kind)
    config = TranslatorConfig(
        cfg.variant, Side.of(src), Side.of(tgt),
        tuple(map(tuple, maps["key"])), tuple(map(tuple, maps["value"])),
        key_cut=cfg.key_cut, bias=cfg.bias,
    )  # fmt: skip
    # one Gram matrix per distinct input-layer tuple, one cross matrix per target layer
    grams: dict[tuple, Moments] = {}
    cross: dict[tuple, np.ndarray] = {}
    out_stats: dict[tuple, list] = {}
    n_tokens = 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("stage 1: accumulating", total=len(examples))
        for ex in examples:
            tokens = ex.prefix + ex.continuation
            s_span = trace(pair.source, tokens, cfg.key_cut)
            t_span = trace(pair.target, tokens, cfg.key_cut)
            seen = set()  # a Gram shared by several target layers gets each example once
            for kind in KINDS:
                xs, ys = layer_features(s_span, kind), layer_features(t_span, kind)
                for t, layers in enumerate(maps[kind]):
                    key = (kind, tuple(layers))
                    x = np.concatenate([xs[s] for s in layers], axis=1).astype(np.float64)
                    y = ys[t].astype(np.float64)
                    if key not in grams:
                        grams[key] = Moments(x.shape[1], 0)
                    if key not in seen:
                        seen.add(key)
                        grams[key].xtx += x.T @ x
                        grams[key].sx += x.sum(0)
                        grams[key].n += len(x)
                    c = x.T @ y
                    st = out_stats.setdefault((kind, t), [0.0, 0.0])
                    cross[kind, t] = cross[kind, t] + c if (kind, t) in cross else c
                    st[0] = st[0] + y.sum(0)
                    st[1] += float((y * y).sum())
            n_tokens += len(tokens)
            bar.advance(task)
    tr = Translator(config)
    fit_report = {}
    for kind in KINDS:
        ws, bs, r2 = [], [], []
        for t, layers in enumerate(maps[kind]):
            g = grams[(kind, tuple(layers))]
            xty, (sy, yy) = cross[kind, t], out_stats[(kind, t)]
            w, b, sse = _solve(config, kind, g, xty, sy, yy, cfg)
            sst = yy - (sy @ sy) / g.n
            r2.append(1 - sse / max(sst, 1e-12))
            ws.append(w)
            bs.append(b)
        params = {"weight": mx.array(np.stack(ws).astype(np.float32))}
        if cfg.bias:
            params["bias"] = mx.array(np.stack(bs).astype(np.float32))
        setattr(tr, kind, params)
        fit_report[kind] = {"r2_mean": float(np.mean(r2)), "r2_min": float(np.min(r2))}
    tr.config.metadata["calibration"] = {
        "stage1": {
            "examples": len(examples), "tokens": n_tokens, "alpha": cfg.alpha,
            "centered": cfg.bias, "train_fit": fit_report,
            "layer_selection": "given" if cfg.key_layers else (
                "nearest by relative depth" if cfg.nu == 1 else
                f"best single-layer ridge fit within +-{cfg.window} of nearest"
            ),
        },
        **cfg.report,
    }  # fmt: skip
    return tr


def _solve(config: TranslatorConfig, kind, g: Moments, xty, sy, yy, cfg):
    """Mixing: one solve. Headwise: per head, on the head's blocks of the same moments."""
    if config.variant == "mixing":
        w, b = ridge(g.xtx, xty, g.sx, sy, g.n, cfg.alpha, cfg.bias)
        return w, b, residual(g.xtx, xty, g.sx, sy, yy, g.n, w, b)
    s, t = config.source, config.target
    ds = s.head_dim if kind == "key" else s.value_dim
    dt = t.head_dim if kind == "key" else t.value_dim
    nu = config.nu_k if kind == "key" else config.nu_v
    ws, bs, sse = [], [], 0.0
    for h in range(t.kv_heads):
        idx = np.concatenate([j * s.kv_heads * ds + h * ds + np.arange(ds) for j in range(nu)])
        out = h * dt + np.arange(dt)
        xtx, cxy = g.xtx[np.ix_(idx, idx)], xty[np.ix_(idx, out)]
        w, b = ridge(xtx, cxy, g.sx[idx], sy[out], g.n, cfg.alpha, cfg.bias)
        ws.append(w)
        bs.append(b)
        # per-head residual needs the head's own y^2 sum; approximate SST split is not needed:
        sse += residual(xtx, cxy, g.sx[idx], sy[out], 0.0, g.n, w, b)
    return np.stack(ws), np.stack(bs), sse + yy
