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

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np
from rich.progress import Progress

from ..capture import layer_features, trace
from ..translator import Side, Translator, TranslatorConfig, nearest_layer_map

KINDS = ("key", "value")


@dataclass
class Stage1Config:
    variant: str = "mixing"
    nu: int = 1
    key_cut: str = "post_norm"
    bias: bool = True  # centering + bias
    native_first: bool = True  # keep the target's own K/V at position 0; fit without it
    # ridge lambda = alpha * mean variance of the (centered) inputs, trace(Cxx) / d; the default
    # is a light touch, but it still shrinks maps: the report gives the fit at alpha 0 beside it
    alpha: float = 1e-3
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
    if alpha == 0:  # plain least squares; lstsq also copes with rank-deficient inputs
        w = np.linalg.lstsq(cxx, cxy, rcond=None)[0]
    else:
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


def _select_layers(pair, examples, cfg: Stage1Config) -> dict[str, list[list[int]]]:
    """Pick nu source layers per target layer, for K and V, by single-layer ridge fit quality."""
    Ls, Lt = pair.source.geometry.layers, pair.target.geometry.layers
    if cfg.nu == 1:
        rows = nearest_layer_map(Ls, Lt, 1)
        return {"key": rows, "value": rows}
    nearest = [r[0] for r in nearest_layer_map(Ls, Lt, 1)]
    cands = [list(range(max(0, c - cfg.window), min(Ls, c + cfg.window + 1))) for c in nearest]
    used = sorted({s for c in cands for s in c})
    stats = {kind: {"gram": {}, "sx": {}, "cross": {}, "sy": {}, "yy": {}} for kind in KINDS}
    n = 0
    for ex in examples[: cfg.selection_examples]:
        tokens = ex.prefix + ex.continuation
        s_span, t_span = (
            trace(pair.source, tokens, cfg.key_cut),
            trace(pair.target, tokens, cfg.key_cut),
        )
        for kind in KINDS:
            st = stats[kind]
            xs = layer_features(s_span, kind).astype(np.float64)
            ys = layer_features(t_span, kind).astype(np.float64)
            for s in used:
                _acc(st["gram"], s, xs[s].T @ xs[s])
                _acc(st["sx"], s, xs[s].sum(0))
            for t in range(Lt):
                _acc(st["sy"], t, ys[t].sum(0))
                _acc(st["yy"], t, float((ys[t] ** 2).sum()))
                for s in cands[t]:
                    _acc(st["cross"], (s, t), xs[s].T @ ys[t])
        n += len(tokens)
    maps = {}
    for kind in KINDS:
        st, rows = stats[kind], []
        for t in range(Lt):
            scores = []
            for s in cands[t]:
                args = (st["gram"][s], st["cross"][s, t], st["sx"][s], st["sy"][t])
                w, b = ridge(*args, n, cfg.alpha, cfg.bias)
                scores.append((residual(*args, st["yy"][t], n, w, b), s))
            rows.append(sorted(s for _, s in sorted(scores)[: cfg.nu]))
        maps[kind] = rows
    return maps


def _acc(d: dict, key, value) -> None:
    d[key] = d[key] + value if key in d else value


def fit_closed_form(
    pair, examples, cfg: Stage1Config = Stage1Config(), progress=True
) -> Translator:
    """Fit a translator for `pair` on `examples` (data.Example) in one streaming pass."""
    return fit_many(pair, examples, [cfg], progress)[0]


def fit_many(pair, examples, cfgs: list[Stage1Config], progress=True) -> list[Translator]:
    """Fit several translators from one pass over the data (variants sharing a key cut).

    Moments are keyed by input-layer tuple (Gram) and (target layer, input layers) (cross), so
    configs that read the same layers (e.g. headwise and mixing) share them.
    """
    st = accumulate(pair, examples, cfgs, progress)
    return [
        _finish(config, cfg, maps, st.grams, st.cross, st.out_stats, st.examples, st.tokens)
        for config, cfg, maps in zip(st.configs, cfgs, st.maps)
    ]


@dataclass
class Statistics:
    """One streaming pass: per config its TranslatorConfig and layer maps; the shared moments
    grams[kind, layers], cross[kind, t, layers] (X'Y), out_stats[kind, t] = [sum y, sum y^2]."""

    configs: list
    maps: list
    grams: dict
    cross: dict
    out_stats: dict
    examples: int
    tokens: int


def accumulate(pair, examples, cfgs: list[Stage1Config], progress=True) -> Statistics:
    """The moments `fit_many` solves from (also the low-rank fit's input)."""
    cuts = {c.key_cut for c in cfgs}
    if len(cuts) != 1:
        raise ValueError("fit_many needs one key cut for all configs")
    (cut,) = cuts
    if len({c.native_first for c in cfgs}) != 1:
        raise ValueError("fit_many needs one native_first setting for all configs")
    src, tgt = pair.source.geometry, pair.target.geometry
    configs, all_maps, selected = [], [], {}
    for cfg in cfgs:
        if cfg.key_layers is None or cfg.value_layers is None:
            key = (cfg.nu, cfg.window, cfg.selection_examples, cfg.alpha, cfg.bias)
            if key not in selected:  # one selection pass shared by configs that agree on it
                selected[key] = _select_layers(pair, examples, cfg)
        maps = {
            "key": cfg.key_layers or selected[key]["key"],
            "value": cfg.value_layers or selected[key]["value"],
        }
        all_maps.append(maps)
        configs.append(TranslatorConfig(
            cfg.variant, Side.of(src), Side.of(tgt),
            tuple(map(tuple, maps["key"])), tuple(map(tuple, maps["value"])),
            key_cut=cut, bias=cfg.bias, native_first=cfg.native_first,
        ))  # fmt: skip
    needed = {
        (kind, t, tuple(layers))
        for m in all_maps
        for kind in KINDS
        for t, layers in enumerate(m[kind])
    }
    grams: dict[tuple, Moments] = {}
    cross: dict[tuple, np.ndarray] = {}
    out_stats: dict[tuple, list] = {}
    n_tokens = 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("stage 1: accumulating", total=len(examples))
        for ex in examples:
            tokens = ex.prefix + ex.continuation
            feats = {}
            s_span, t_span = trace(pair.source, tokens, cut), trace(pair.target, tokens, cut)
            skip = 1 if cfgs[0].native_first else 0  # position 0 stays native: not fitted
            for kind in KINDS:
                xs, ys = layer_features(s_span, kind), layer_features(t_span, kind)
                feats[kind] = (xs[:, skip:], ys[:, skip:])
            inputs, seen_y = {}, set()
            for kind, t, layers in sorted(needed):
                xs, ys = feats[kind]
                if (kind, layers) not in inputs:
                    x = np.concatenate([xs[s] for s in layers], axis=1).astype(np.float64)
                    inputs[kind, layers] = x
                    g = grams.setdefault((kind, layers), Moments(x.shape[1], 0))
                    g.xtx += x.T @ x
                    g.sx += x.sum(0)
                    g.n += len(x)
                x, y = inputs[kind, layers], ys[t].astype(np.float64)
                c = x.T @ y
                cross[kind, t, layers] = (
                    cross[kind, t, layers] + c if (kind, t, layers) in cross else c
                )
                if (kind, t) not in seen_y:  # target statistics once per example
                    seen_y.add((kind, t))
                    st = out_stats.setdefault((kind, t), [0.0, 0.0])
                    st[0], st[1] = st[0] + y.sum(0), st[1] + float((y * y).sum())
            n_tokens += len(tokens)
            bar.advance(task)
    return Statistics(configs, all_maps, grams, cross, out_stats, len(examples), n_tokens)


def _finish(config, cfg, maps, grams, cross, out_stats, n_examples, n_tokens) -> Translator:
    tr = Translator(config)
    fit_report = {}
    for kind in KINDS:
        ws, bs, r2, r2_alpha0 = [], [], [], []
        for t, layers in enumerate(maps[kind]):
            g = grams[(kind, tuple(layers))]
            xty, (sy, yy) = cross[kind, t, tuple(layers)], out_stats[(kind, t)]
            w, b, sse = _solve(config, kind, g, xty, sy, yy, cfg)
            sst = yy - (sy @ sy) / g.n
            r2.append(1 - sse / max(sst, 1e-12))
            if cfg.alpha != 0:  # the unregularized fit, for the report
                sse0 = _solve(config, kind, g, xty, sy, yy, replace(cfg, alpha=0.0))[2]
                r2_alpha0.append(1 - sse0 / max(sst, 1e-12))
            ws.append(w)
            bs.append(b)
        params = {"weight": mx.array(np.stack(ws).astype(np.float32))}
        if cfg.bias:
            params["bias"] = mx.array(np.stack(bs).astype(np.float32))
        setattr(tr, kind, params)
        fit_report[kind] = {
            "r2_mean": float(np.mean(r2)),
            "r2_min": float(np.min(r2)),
            "r2_mean_alpha0": float(np.mean(r2_alpha0)) if r2_alpha0 else float(np.mean(r2)),
        }
    tr.config.metadata["calibration"] = {
        "stage1": {
            "examples": n_examples, "tokens": n_tokens, "alpha": cfg.alpha,
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
