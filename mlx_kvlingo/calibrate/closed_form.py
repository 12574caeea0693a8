"""Stage 1: per target layer and for K and V, ridge least squares from source features to the
target's native features, from streaming normal equations in float64 (memory does not grow
with the number of tokens).

Inputs are the `nu` source layers of the layer map, concatenated per token. Head-wise maps are
solved per head from the corresponding blocks of the same normal equations. With no layer map
and nu > 1, source layers are chosen per target layer by the best single-layer fit (lowest
held-in residual of a one-layer ridge map), among a window of candidates around the
nearest-by-depth layer.

The ridge can shrink toward a prior map W0 instead of zero (`prior`): the identity on the
nearest-by-depth layer where head geometry matches, or a translator file (e.g. the fit of a
related pair); `alpha_grid` picks the strength per target layer and kind by the residual on
held-out documents (moments accumulated apart, then added back for the final solve).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from rich.progress import Progress

from ..capture import layer_features, trace
from ..format import config_from_metadata, load_translator, read_metadata
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
    # what the ridge shrinks toward: "zero", "identity" or the path of a translator file
    prior: str = "zero"
    # with a grid, alpha is chosen per (kind, target layer) by the residual on held-out
    # documents (`validation_fraction` of them, by hash of the document name)
    alpha_grid: tuple[float, ...] | None = None
    validation_fraction: float = 0.2
    report: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.alpha < 0 or any(a < 0 for a in self.alpha_grid or ()):
            raise ValueError(f"ridge alpha must be >= 0 (got {self.alpha}, {self.alpha_grid})")
        if self.alpha_grid is not None and not self.alpha_grid:
            raise ValueError("alpha_grid is empty; give None for a fixed alpha")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must be in (0, 1), got {self.validation_fraction}"
            )
        if self.prior not in PRIORS and not Path(self.prior).is_file():
            raise ValueError(
                f"prior {self.prior!r} is neither one of {PRIORS} nor a translator file"
            )


PRIORS = ("zero", "identity")


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


def ridge(xtx, xty, sx, sy, n, alpha: float, center: bool, prior=None):
    """Solve min ||X W + b - Y||^2 + lam ||W - W0||^2 with lam = alpha * mean diag of the
    covariance: (Cxx + lam I) W = Cxy + lam W0. W0 = `prior` (None: zero); alpha 0 is the
    plain least-squares fit, whatever the prior."""
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
        rhs = cxy if prior is None else cxy + lam * prior
        w = np.linalg.solve(cxx + lam * np.eye(len(cxx)), rhs)
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

    With an `alpha_grid` in any config, the documents `is_validation` picks are accumulated
    apart and used to choose alpha (then added back for the final solve).
    """
    acc = Stage1Accumulator(pair, cfgs, examples)
    split = next((c.validation_fraction for c in cfgs if c.alpha_grid), None)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("stage 1: accumulating", total=len(examples))
        for ex in examples:
            acc.add(ex, validation=split is not None and is_validation(ex, split))
            bar.advance(task)
    return acc.solve()


def document_of(ex) -> str:
    """The document an example was drawn from ("file:line" of a chat, "file@block" of a text)."""
    return ex.source.split("#")[0].split("+")[0]


def is_validation(ex, fraction: float) -> bool:
    """Deterministic document-level split: the same document always lands on the same side."""
    h = int.from_bytes(hashlib.sha1(document_of(ex).encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class _Moments:
    """Moments of one split: Grams per (kind, input layers), cross per (kind, t, layers),
    target sums per (kind, t)."""

    def __init__(self):
        self.grams: dict[tuple, Moments] = {}
        self.cross: dict[tuple, np.ndarray] = {}
        self.out: dict[tuple, list] = {}
        self.examples = 0
        self.tokens = 0

    def merged(self, other: _Moments) -> _Moments:
        m = _Moments()
        for key in self.grams.keys() | other.grams.keys():
            a, b = self.grams.get(key), other.grams.get(key)
            if a is None or b is None:
                m.grams[key] = a or b
                continue
            g = Moments(len(a.sx), 0)
            g.xtx, g.sx, g.n = a.xtx + b.xtx, a.sx + b.sx, a.n + b.n
            m.grams[key] = g
        for key in self.cross.keys() | other.cross.keys():
            m.cross[key] = self.cross.get(key, 0) + other.cross.get(key, 0)
        for key in self.out.keys() | other.out.keys():
            a, b = self.out.get(key, [0.0, 0.0]), other.out.get(key, [0.0, 0.0])
            m.out[key] = [a[0] + b[0], a[1] + b[1]]
        m.examples, m.tokens = self.examples + other.examples, self.tokens + other.tokens
        return m


class Stage1Accumulator:
    """Streaming normal equations for several configs (one key cut); `solve()` at any point.

    Moments are keyed by input-layer tuple (Gram) and (target layer, input layers) (cross), so
    configs that read the same layers (e.g. headwise and mixing) share them. `add` accepts
    precomputed spans (callers that fit several pairs sharing a target trace it once).
    """

    def __init__(self, pair, cfgs: list[Stage1Config], selection_examples=()):
        cuts = {c.key_cut for c in cfgs}
        if len(cuts) != 1:
            raise ValueError("fit_many needs one key cut for all configs")
        if len({c.native_first for c in cfgs}) != 1:
            raise ValueError("fit_many needs one native_first setting for all configs")
        (self.cut,) = cuts
        self.pair, self.cfgs = pair, list(cfgs)
        src, tgt = pair.source.geometry, pair.target.geometry
        self.configs, self.maps, selected = [], [], {}
        for cfg in cfgs:
            given = _prior_maps(cfg.prior)
            key_layers = cfg.key_layers or (given and given["key"])
            value_layers = cfg.value_layers or (given and given["value"])
            if key_layers is None or value_layers is None:
                key = (cfg.nu, cfg.window, cfg.selection_examples, cfg.alpha, cfg.bias)
                if key not in selected:  # one selection pass shared by configs that agree on it
                    selected[key] = _select_layers(pair, selection_examples, cfg)
            maps = {
                "key": key_layers or selected[key]["key"],
                "value": value_layers or selected[key]["value"],
            }
            self.maps.append(maps)
            self.configs.append(TranslatorConfig(
                cfg.variant, Side.of(src), Side.of(tgt),
                tuple(map(tuple, maps["key"])), tuple(map(tuple, maps["value"])),
                key_cut=self.cut, bias=cfg.bias, native_first=cfg.native_first,
            ))  # fmt: skip
        self.priors = [
            prior_weights(config, cfg.prior, pair) for config, cfg in zip(self.configs, cfgs)
        ]
        self.needed = sorted({
            (kind, t, tuple(layers))
            for m in self.maps
            for kind in KINDS
            for t, layers in enumerate(m[kind])
        })  # fmt: skip
        self.fit, self.validation = _Moments(), _Moments()

    def add(self, ex, validation: bool = False, s_span=None, t_span=None) -> None:
        """Accumulate one example (into the validation moments with `validation`)."""
        tokens = ex.prefix + ex.continuation
        s_span = s_span if s_span is not None else trace(self.pair.source, tokens, self.cut)
        t_span = t_span if t_span is not None else trace(self.pair.target, tokens, self.cut)
        m = self.validation if validation else self.fit
        skip = 1 if self.cfgs[0].native_first else 0  # position 0 stays native: not fitted
        feats = {}
        for kind in KINDS:
            xs, ys = layer_features(s_span, kind), layer_features(t_span, kind)
            feats[kind] = (xs[:, skip:], ys[:, skip:])
        inputs, seen_y = {}, set()
        for kind, t, layers in self.needed:
            xs, ys = feats[kind]
            if (kind, layers) not in inputs:
                x = np.concatenate([xs[s] for s in layers], axis=1).astype(np.float64)
                inputs[kind, layers] = x
                g = m.grams.setdefault((kind, layers), Moments(x.shape[1], 0))
                g.xtx += x.T @ x
                g.sx += x.sum(0)
                g.n += len(x)
            x, y = inputs[kind, layers], ys[t].astype(np.float64)
            c = x.T @ y
            m.cross[kind, t, layers] = (
                m.cross[kind, t, layers] + c if (kind, t, layers) in m.cross else c
            )
            if (kind, t) not in seen_y:  # target statistics once per example
                seen_y.add((kind, t))
                st = m.out.setdefault((kind, t), [0.0, 0.0])
                st[0], st[1] = st[0] + y.sum(0), st[1] + float((y * y).sum())
        m.examples += 1
        m.tokens += len(tokens)

    def solve(self, refit_with_validation: bool = True) -> list[Translator]:
        """The translators from the moments so far (does not consume them). The validation
        documents choose alpha, then join the final fit unless `refit_with_validation` is off
        (learning curves: the map sees exactly the fitting examples)."""
        if not self.fit.examples:
            raise ValueError("stage 1 has no fitting examples (all went to validation?)")
        merge = refit_with_validation and self.validation.examples
        everything = self.fit.merged(self.validation) if merge else self.fit
        return [
            _finish_split(config, cfg, maps, prior, everything, self.fit, self.validation)
            for config, cfg, maps, prior in zip(self.configs, self.cfgs, self.maps, self.priors)
        ]


@dataclass
class Statistics:
    """One streaming pass, as the low-rank fit reads it: per config its TranslatorConfig and
    layer maps; the moments grams[kind, layers], cross[kind, t, layers] (X'Y), out_stats[kind, t]
    = [sum y, sum y^2]."""

    configs: list
    maps: list
    grams: dict
    cross: dict
    out_stats: dict
    examples: int
    tokens: int


def accumulate(pair, examples, cfgs: list[Stage1Config], progress=True) -> Statistics:
    """The moments `fit_many` solves from, all examples fitted (no validation split)."""
    acc = Stage1Accumulator(pair, cfgs, examples)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("stage 1: accumulating", total=len(examples))
        for ex in examples:
            acc.add(ex)
            bar.advance(task)
    m = acc.fit
    return Statistics(acc.configs, acc.maps, m.grams, m.cross, m.out, m.examples, m.tokens)


def _finish(config, cfg, maps, grams, cross, out_stats, n_examples, n_tokens) -> Translator:
    """The solve from `Statistics` moments at cfg.alpha, toward cfg.prior."""
    m = _Moments()
    m.grams, m.cross, m.out, m.examples, m.tokens = grams, cross, out_stats, n_examples, n_tokens
    prior = prior_weights(config, cfg.prior)
    return _finish_split(config, replace(cfg, alpha_grid=None), maps, prior, m, m, _Moments())


# -- priors ------------------------------------------------------------------------------------


def _prior_maps(prior: str) -> dict | None:
    """A translator-file prior fixes the layer maps (its weights only fit those)."""
    if prior in PRIORS:
        return None
    config = config_from_metadata(read_metadata(Path(prior)))
    return {
        "key": [list(r) for r in config.key_layers],
        "value": [list(r) for r in config.value_layers],
    }


def prior_weights(config: TranslatorConfig, prior: str, pair=None) -> dict | None:
    """W0 per kind, shaped like the translator's weights (float64), or None for zero."""
    if prior == "zero":
        return None
    shapes = config.weight_shapes()
    if prior == "identity":
        s, t = config.source, config.target
        if (s.kv_heads, s.head_dim, s.value_dim) != (t.kv_heads, t.head_dim, t.value_dim):
            raise ValueError(
                "an identity prior needs the same KV heads and head sizes on both sides "
                f"(source {s.kv_heads}x{s.head_dim}/{s.value_dim}, "
                f"target {t.kv_heads}x{t.head_dim}/{t.value_dim})"
            )
        nearest = [r[0] for r in nearest_layer_map(s.layers, t.layers, 1)]
        out = {}
        for kind in KINDS:
            rows = config.key_layers if kind == "key" else config.value_layers
            d = s.head_dim if kind == "key" else s.value_dim
            w = np.zeros(shapes[f"{kind}.weight"])
            for li, row in enumerate(rows):
                # the row's layer closest in depth to the nearest one carries the identity
                j = min(range(len(row)), key=lambda i: (abs(row[i] - nearest[li]), i))
                if config.variant == "mixing":
                    width = s.kv_heads * d
                    w[li, j * width : (j + 1) * width, :] = np.eye(width)
                else:
                    w[li, :, j * d : (j + 1) * d, :] = np.eye(d)
            out[kind] = w
        return out
    tr = load_translator(prior)
    if tr.config.variant != config.variant or tr.config.weight_shapes() != shapes:
        raise ValueError(
            f"prior {prior}: a {tr.config.variant} translator with weights "
            f"{tr.config.weight_shapes()}, this fit needs a {config.variant} one with {shapes}"
        )
    return {kind: np.array(getattr(tr, kind)["weight"].astype(mx.float32), dtype=np.float64)
            for kind in KINDS}  # fmt: skip


# -- solving -----------------------------------------------------------------------------------


def _finish_split(
    config, cfg, maps, prior, m: _Moments, fit: _Moments, val: _Moments
) -> Translator:
    tr = Translator(config)
    fit_report, chosen = {}, {}
    grid = cfg.alpha_grid if cfg.alpha_grid and val.examples and fit.examples else None
    for kind in KINDS:
        ws, bs, r2, r2_alpha0, alphas = [], [], [], [], []
        for t, layers in enumerate(maps[kind]):
            w0 = None if prior is None else prior[kind][t]
            key = (kind, tuple(layers))
            alpha = cfg.alpha
            if grid:
                residuals = [
                    _validation_residual(config, kind, t, key, fit, val, w0, replace(cfg, alpha=a))
                    for a in grid
                ]
                alpha = grid[int(np.argmin(residuals))]
            alphas.append(alpha)
            g = m.grams[key]
            xty, (sy, yy) = m.cross[kind, t, tuple(layers)], m.out[(kind, t)]
            c = replace(cfg, alpha=alpha)
            w, b, sse = _solve(config, kind, g, xty, sy, yy, c, w0)
            sst = yy - (sy @ sy) / g.n
            r2.append(1 - sse / max(sst, 1e-12))
            if alpha != 0:  # the unregularized fit, for the report
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
        chosen[kind] = alphas
    stage1 = {
        "examples": m.examples, "tokens": m.tokens, "alpha": cfg.alpha,
        "centered": cfg.bias, "train_fit": fit_report,
        "prior": cfg.prior if cfg.prior in PRIORS else f"translator {Path(cfg.prior).name}",
        "layer_selection": "given" if cfg.key_layers else (
            "nearest by relative depth" if cfg.nu == 1 else
            f"best single-layer ridge fit within +-{cfg.window} of nearest"
        ),
    }  # fmt: skip
    if grid:
        stage1.update(alpha="chosen per layer", alpha_grid=list(grid), alphas=chosen,
                      validation_examples=val.examples)  # fmt: skip
    tr.config.metadata["calibration"] = {"stage1": stage1, **cfg.report}
    return tr


def _validation_residual(config, kind, t, key, fit: _Moments, val: _Moments, w0, cfg) -> float:
    """Residual on the validation moments of the map fitted on the fitting moments alone."""
    layers = key[1]
    g, xty, (sy, _) = fit.grams[key], fit.cross[kind, t, layers], fit.out[(kind, t)]
    w, b, _ = _solve(config, kind, g, xty, sy, 0.0, cfg, w0)
    gv, xtyv, (syv, yyv) = val.grams[key], val.cross[kind, t, layers], val.out[(kind, t)]
    if config.variant == "mixing":
        return residual(gv.xtx, xtyv, gv.sx, syv, yyv, gv.n, w, b)
    total = yyv
    for h, (idx, out) in enumerate(_head_blocks(config, kind)):
        total += residual(gv.xtx[np.ix_(idx, idx)], xtyv[np.ix_(idx, out)], gv.sx[idx],
                          syv[out], 0.0, gv.n, w[h], b[h])  # fmt: skip
    return total


def _head_blocks(config: TranslatorConfig, kind):
    """(input indices, output indices) of each target head in the concatenated features."""
    s, t = config.source, config.target
    ds = s.head_dim if kind == "key" else s.value_dim
    dt = t.head_dim if kind == "key" else t.value_dim
    nu = config.nu_k if kind == "key" else config.nu_v
    return [
        (
            np.concatenate([j * s.kv_heads * ds + h * ds + np.arange(ds) for j in range(nu)]),
            h * dt + np.arange(dt),
        )
        for h in range(t.kv_heads)
    ]


def _solve(config: TranslatorConfig, kind, g: Moments, xty, sy, yy, cfg, prior=None):
    """Mixing: one solve. Headwise: per head, on the head's blocks of the same moments."""
    if config.variant == "mixing":
        w, b = ridge(g.xtx, xty, g.sx, sy, g.n, cfg.alpha, cfg.bias, prior)
        return w, b, residual(g.xtx, xty, g.sx, sy, yy, g.n, w, b)
    ws, bs, sse = [], [], 0.0
    for h, (idx, out) in enumerate(_head_blocks(config, kind)):
        xtx, cxy = g.xtx[np.ix_(idx, idx)], xty[np.ix_(idx, out)]
        w0 = None if prior is None else prior[h]
        w, b = ridge(xtx, cxy, g.sx[idx], sy[out], g.n, cfg.alpha, cfg.bias, w0)
        ws.append(w)
        bs.append(b)
        # per-head residuals without the y^2 term; the total y^2 is added once
        sse += residual(xtx, cxy, g.sx[idx], sy[out], 0.0, g.n, w, b)
    return np.stack(ws), np.stack(bs), sse + yy
