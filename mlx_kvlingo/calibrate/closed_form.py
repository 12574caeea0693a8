"""Stage 1: per target layer and for K and V, ridge least squares from the `nu` source layers'
features (concatenated per token) to the target's native ones, from streaming normal equations
in float64 (`Moments`); head-wise maps from the per-head blocks of the same equations.

With no layer map and nu > 1, each target layer reads the nu best single-layer fits within a
window around the nearest-by-depth layer. The ridge shrinks toward a prior W0 (`prior`: zero,
the identity, or a translator file); `alpha_grid` picks its strength per layer and kind by the
residual on held-out documents.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvlingo.kv.capture import layer_features, trace
from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig, nearest_layer_map
from mlx_kvlingo.models.files import config_from_metadata, load_translator, read_metadata

import mlx.core as mx
import numpy as np

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
    # documents (VALIDATION_FRACTION of them, by hash of the document name)
    alpha_grid: tuple[float, ...] | None = None
    report: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.alpha < 0 or any(a < 0 for a in self.alpha_grid or ()):
            raise ValueError(f"ridge alpha must be >= 0 (got {self.alpha}, {self.alpha_grid})")
        if self.alpha_grid is not None and not self.alpha_grid:
            raise ValueError("alpha_grid is empty; give None for a fixed alpha")
        if self.prior not in PRIORS and not Path(self.prior).is_file():
            raise ValueError(
                f"prior {self.prior!r} is neither one of {PRIORS} nor a translator file"
            )


PRIORS = ("zero", "identity")
VALIDATION_FRACTION = 0.2


class Moments:
    """Streaming normal equations of one split of the data, in float64: memory does not grow
    with the number of tokens. With X the features of the source layers `layers` concatenated
    per token and Y those of target layer t, for `kind` "key" or "value":

        xtx[kind, layers] = X'X        sx[kind, layers] = sum of the rows of X
        xty[kind, t, layers] = X'Y     sy[kind, t] = sum of the rows of Y
                                       yy[kind, t] = sum of Y**2 (a float)

    `n` counts the rows (token positions fitted; the same for every key), `examples` and
    `tokens` what was added. Sums start from the first addition (no zeros added first) and run
    in the order examples arrive, so the same examples in the same order give the same bits.
    """

    def __init__(self):
        self.xtx: dict[tuple, np.ndarray] = {}
        self.sx: dict[tuple, np.ndarray] = {}
        self.xty: dict[tuple, np.ndarray] = {}
        self.sy: dict[tuple, np.ndarray] = {}
        self.yy: dict[tuple, float] = {}
        self.n = self.examples = self.tokens = 0

    def add(self, features: dict, needed, tokens: int) -> None:
        """Accumulate one example. `features[kind]` = (source, target) layer features, each
        (layers, rows, width) as `capture.layer_features` gives them (rows alike on both
        sides); `needed`: the (kind, t, layers) problems to accumulate, each input block and
        each target layer's sums once; `tokens`: the example's length, for the report."""
        inputs, seen_y = {}, set()
        for kind, t, layers in needed:
            xs, ys = features[kind]
            if (kind, layers) not in inputs:
                x = np.concatenate([xs[s] for s in layers], axis=1).astype(np.float64)
                inputs[kind, layers] = x
                _acc(self.xtx, (kind, layers), x.T @ x)
                _acc(self.sx, (kind, layers), x.sum(0))
            x, y = inputs[kind, layers], ys[t].astype(np.float64)
            _acc(self.xty, (kind, t, layers), x.T @ y)
            if (kind, t) not in seen_y:
                seen_y.add((kind, t))
                _acc(self.sy, (kind, t), y.sum(0))
                _acc(self.yy, (kind, t), float((y * y).sum()))
        self.n += next(iter(features.values()))[0].shape[1]
        self.examples += 1
        self.tokens += tokens

    def merged(self, other: Moments) -> Moments:
        """The sums of both splits (a key missing from one takes the other's sums)."""
        m = Moments()
        for name in ("xtx", "sx", "xty", "sy", "yy"):
            a, b = getattr(self, name), getattr(other, name)
            both = {k: a[k] + b[k] if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
            setattr(m, name, both)
        m.n, m.examples = self.n + other.n, self.examples + other.examples
        m.tokens = self.tokens + other.tokens
        return m

    def problem(self, kind: str, t: int, layers) -> tuple:
        """(X'X, X'Y, sum x, sum y, sum y^2, n) of target layer t of `kind` read from source
        `layers`: the arguments of `residual` (`ridge` takes them less sum y^2)."""
        layers = tuple(layers)
        return (self.xtx[kind, layers], self.xty[kind, t, layers], self.sx[kind, layers],
                self.sy[kind, t], self.yy[kind, t], self.n)  # fmt: skip


def _acc(d: dict, key, value) -> None:
    d[key] = d[key] + value if key in d else value


def ridge(xtx, xty, sx, sy, n, alpha: float, center: bool, prior=None):
    """Solve min ||X W + b - Y||^2 + lam ||W - W0||^2 with lam = alpha * mean diag of the
    covariance: (Cxx + lam I) W = Cxy + lam W0. W0 = `prior` (None: zero); alpha 0 is the
    plain least-squares fit, whatever the prior."""
    cxx, cxy = xtx, xty
    if center:  # cov-like sums
        mx_, my = sx / n, sy / n
        cxx, cxy = xtx - n * np.outer(mx_, mx_), xty - n * np.outer(mx_, my)
    if alpha == 0:  # plain least squares; lstsq also copes with rank-deficient inputs
        w = np.linalg.lstsq(cxx, cxy, rcond=None)[0]
    else:
        lam = alpha * max(np.trace(cxx) / len(cxx), 1e-12)
        rhs = cxy if prior is None else cxy + lam * prior
        w = np.linalg.solve(cxx + lam * np.eye(len(cxx)), rhs)
    b = sy / n - (sx / n) @ w if center else np.zeros(w.shape[1])
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


def _features(pair, ex, cut: str, skip: int = 0, s_span=None, t_span=None) -> dict:
    """{kind: (source, target) layer features} of an example's positions from `skip` on (spans
    traced here unless given)."""
    tokens = ex.prefix + ex.continuation
    s_span = s_span if s_span is not None else trace(pair.source, tokens, cut)
    t_span = t_span if t_span is not None else trace(pair.target, tokens, cut)
    return {
        k: (layer_features(s_span, k)[:, skip:], layer_features(t_span, k)[:, skip:]) for k in KINDS
    }


def _select_layers(pair, examples, cfg: Stage1Config) -> dict[str, list[list[int]]]:
    """Pick nu source layers per target layer, for K and V, by single-layer ridge fit quality."""
    Ls, Lt = pair.source.geometry.layers, pair.target.geometry.layers
    if cfg.nu == 1:
        rows = nearest_layer_map(Ls, Lt, 1)
        return {"key": rows, "value": rows}
    nearest = [r[0] for r in nearest_layer_map(Ls, Lt, 1)]
    cands = [list(range(max(0, c - cfg.window), min(Ls, c + cfg.window + 1))) for c in nearest]
    needed = sorted({(kind, t, (s,)) for kind in KINDS for t in range(Lt) for s in cands[t]})
    m = Moments()  # every position, position 0 too
    for ex in examples[: cfg.selection_examples]:
        m.add(_features(pair, ex, cfg.key_cut), needed, len(ex.prefix + ex.continuation))

    def chosen(kind: str, t: int) -> list[int]:  # the nu with the smallest residuals
        scores = []
        for s in cands[t]:
            xtx, xty, sx, sy, _, n = problem = m.problem(kind, t, (s,))
            scores.append((residual(*problem, *ridge(xtx, xty, sx, sy, n, cfg.alpha, cfg.bias)), s))
        return sorted(s for _, s in sorted(scores)[: cfg.nu])

    return {kind: [chosen(kind, t) for t in range(Lt)] for kind in KINDS}


def fit_closed_form(
    pair, examples, cfg: Stage1Config = Stage1Config(), progress=None
) -> Translator:
    """Fit a translator for `pair` on `examples` (data.Example) in one streaming pass."""
    return fit_many(pair, examples, [cfg], progress)[0]


def fit_many(pair, examples, cfgs: list[Stage1Config], progress=None) -> list[Translator]:
    """Fit several translators (sharing a key cut) from one pass over the data; with an
    `alpha_grid`, the `is_validation` documents choose alpha, then join the final solve.
    `progress(done, total)` after each example (mlx-lm's prompt progress callback shape)."""
    grid = any(c.alpha_grid for c in cfgs)
    acc = Stage1Accumulator(pair, cfgs, examples)
    for i, ex in enumerate(examples):
        acc.add(ex, validation=grid and is_validation(ex, VALIDATION_FRACTION))
        if progress:
            progress(i + 1, len(examples))
    return acc.solve()


def document_of(ex) -> str:
    """The document an example was drawn from ("file:line" of a chat, "file@block" of a text)."""
    return ex.source.split("#")[0].split("+")[0]


def is_validation(ex, fraction: float) -> bool:
    """Deterministic document-level split: the same document always lands on the same side."""
    h = int.from_bytes(hashlib.sha1(document_of(ex).encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class Stage1Accumulator:
    """Streaming normal equations for several configs (one key cut); `solve()` at any point.
    Two `Moments` splits, `fit` and `validation`, keyed by input layers and target layer: configs
    that read the same layers share them. `add` accepts precomputed spans."""

    def __init__(self, pair, cfgs: list[Stage1Config], selection_examples=()):
        self.pair, self.cfgs = pair, list(cfgs)
        if len({(c.key_cut, c.native_first) for c in self.cfgs}) != 1:
            raise ValueError("fit_many needs one key cut and one native_first for all configs")
        self.cut = self.cfgs[0].key_cut
        src, tgt = pair.source.geometry, pair.target.geometry
        self.configs, self.maps, selected = [], [], {}
        for cfg in cfgs:
            given = {}  # a translator-file prior fixes the layer maps (its weights only fit those)
            if cfg.prior not in PRIORS:
                meta = config_from_metadata(read_metadata(Path(cfg.prior)))
                given = {kind: [list(r) for r in getattr(meta, f"{kind}_layers")] for kind in KINDS}
            maps = {kind: getattr(cfg, f"{kind}_layers") or given.get(kind) for kind in KINDS}
            if None in maps.values():
                key = (cfg.nu, cfg.window, cfg.selection_examples, cfg.alpha, cfg.bias)
                if key not in selected:  # one selection pass shared by configs that agree on it
                    selected[key] = _select_layers(pair, selection_examples, cfg)
                maps = {kind: maps[kind] or selected[key][kind] for kind in KINDS}
            self.maps.append(maps)
            self.configs.append(TranslatorConfig(
                cfg.variant, Side.of(src), Side.of(tgt),
                tuple(map(tuple, maps["key"])), tuple(map(tuple, maps["value"])),
                key_cut=self.cut, bias=cfg.bias, native_first=cfg.native_first,
            ))  # fmt: skip
        self.priors = [prior_weights(config, cfg.prior) for config, cfg in zip(self.configs, cfgs)]
        self.needed = sorted({
            (kind, t, tuple(layers))
            for m in self.maps
            for kind in KINDS
            for t, layers in enumerate(m[kind])
        })  # fmt: skip
        self.fit, self.validation = Moments(), Moments()

    def add(self, ex, validation: bool = False, s_span=None, t_span=None) -> None:
        """Accumulate one example (into the validation moments with `validation`)."""
        skip = 1 if self.cfgs[0].native_first else 0  # position 0 stays native: not fitted
        features = _features(self.pair, ex, self.cut, skip, s_span, t_span)
        moments = self.validation if validation else self.fit
        moments.add(features, self.needed, len(ex.prefix + ex.continuation))

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


def prior_weights(config: TranslatorConfig, prior: str) -> dict | None:
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


def _finish_split(config, cfg, maps, prior, m: Moments, fit: Moments, val: Moments) -> Translator:
    """The translator solved from the moments `m`; with an alpha grid (and both splits
    non-empty), alpha per target layer by the residual on `val` of the map fitted on `fit`."""
    tr = Translator(config)
    fit_report, chosen = {}, {}
    grid = cfg.alpha_grid if cfg.alpha_grid and val.examples and fit.examples else None
    for kind in KINDS:
        ws, bs, r2, r2_alpha0, alphas = [], [], [], [], []
        for t, layers in enumerate(maps[kind]):
            w0 = None if prior is None else prior[kind][t]
            alpha = cfg.alpha
            if grid:  # the residual on `val` of the map fitted on `fit` alone
                errors = []
                for a in grid:
                    w, b, _ = _solve(config, kind, fit.problem(kind, t, layers), a, cfg.bias, w0)
                    errors.append(_sse(config, kind, val.problem(kind, t, layers), w, b))
                alpha = grid[int(np.argmin(errors))]
            alphas.append(alpha)
            problem = m.problem(kind, t, layers)
            _, _, _, sy, yy, n = problem
            w, b, sse = _solve(config, kind, problem, alpha, cfg.bias, w0)
            sst = yy - (sy @ sy) / n
            r2.append(1 - sse / max(sst, 1e-12))
            if alpha != 0:  # the unregularized fit, for the report
                sse0 = _solve(config, kind, problem, 0.0, cfg.bias)[2]
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


def _solve(config: TranslatorConfig, kind, problem: tuple, alpha: float, center: bool, prior=None):
    """(W, b, residual) on `problem` (`Moments.problem`). Mixing: one solve. Headwise: per
    head, on the head's blocks of the same moments."""
    xtx, xty, sx, sy, _, n = problem
    if config.variant == "mixing":
        w, b = ridge(xtx, xty, sx, sy, n, alpha, center, prior)
        return w, b, _sse(config, kind, problem, w, b)
    ws, bs = [], []
    for h, (idx, out) in enumerate(_head_blocks(config, kind)):
        w0 = None if prior is None else prior[h]
        w, b = ridge(xtx[np.ix_(idx, idx)], xty[np.ix_(idx, out)], sx[idx], sy[out], n,
                     alpha, center, w0)  # fmt: skip
        ws.append(w)
        bs.append(b)
    w, b = np.stack(ws), np.stack(bs)
    return w, b, _sse(config, kind, problem, w, b)


def _sse(config: TranslatorConfig, kind, problem: tuple, w, b) -> float:
    """||X W + 1 b - Y||^2 of a map on the moments `problem`; headwise from each head's blocks,
    without the y^2 term, which is added once."""
    if config.variant == "mixing":
        return residual(*problem, w, b)
    xtx, xty, sx, sy, yy, n = problem
    sse = 0.0
    for h, (idx, out) in enumerate(_head_blocks(config, kind)):
        sse += residual(xtx[np.ix_(idx, idx)], xty[np.ix_(idx, out)], sx[idx], sy[out], 0.0, n,
                        w[h], b[h])  # fmt: skip
    return sse + yy
