"""Stage 1 for the low-rank translator (`mlx_kvlingo/kv/lowrank.py`): reduced-rank ridge regression
from the same streaming moments as the full-rank fit (`closed_form.Moments`).

For one kind (keys or values):
1. the full-rank ridge map W_t per target layer, as `closed_form` solves it;
2. per source layer s, with A_s = Cov(x_s) + lam_s I (the ridge-regularized input covariance),
   the SVD of A_s^(1/2) [W_t^(s) for every target layer t that reads s] (W_t^(s): the rows of
   W_t that read s) gives the encoder E_s = A_s^(-1/2) U_r: the r input directions that carry
   most of what those target layers need. For nu = 1 this is the exact optimum of the ridge
   objective summed over those target layers under the rank constraint; for nu > 1 each block
   is a partial map, so it is the same recipe, not a proven optimum;
3. per target layer, the decoder D_t is the ridge solution restricted to the codes:
   D_t = (E^T (Cov(x) + lam I) E)^(-1) E^T Cov(x, y) with E = blockdiag(E_l1, ..., E_lnu), the
   bias b_t = mean(y) - mean(x) E D_t. At r = full width, E D_t = W_t exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvlingo.calibrate.closed_form import (
    KINDS,
    Moments,
    Stage1Accumulator,
    Stage1Config,
    centered,
    residual,
    ridge,
    ridge_lambda,
)
from mlx_kvlingo.kv.lowrank import LowRankTranslator
from mlx_kvlingo.kv.translator import TranslatorConfig

import mlx.core as mx
import numpy as np


def fit_lowrank(
    pair, examples, ranks: Sequence[int], cfg: Stage1Config = Stage1Config(), progress=True
) -> list[LowRankTranslator]:
    """One low-rank translator per rank in `ranks`, from one streaming pass over `examples`.

    `cfg` is the full-rank mixing fit's configuration (layer maps, nu, cut, bias, alpha).
    """
    return fit_lowrank_with_full(pair, examples, ranks, cfg, progress)[1]


def fit_lowrank_with_full(pair, examples, ranks, cfg: Stage1Config, progress=True):
    """(the full-rank mixing translator, [low-rank translators]) from one pass."""
    if cfg.variant != "mixing":
        raise ValueError(f"the low-rank fit factors the mixing maps, not {cfg.variant!r}")
    # every example is fitted (no validation split: alpha is cfg.alpha, alpha_grid or not)
    acc = Stage1Accumulator(pair, [cfg], examples).add_all(examples, progress=progress)
    (full,), (config,), (maps,) = acc.solve(), acc.configs, acc.maps
    out = []
    for rank in ranks:
        lr_config = TranslatorConfig(
            "lowrank", config.source, config.target, config.key_layers, config.value_layers,
            config.key_cut, config.bias, config.native_first, rank=_clamp(config, rank),
        )  # fmt: skip
        tr = LowRankTranslator(lr_config)
        report = {}
        for kind in KINDS:
            rows = [tuple(r) for r in maps[kind]]
            width = lr_config.code_width(kind)
            params, report[kind] = factor(rows, acc.fit, kind, config.source.layers, width, cfg)
            setattr(tr, kind, {k: mx.array(v.astype(np.float32)) for k, v in params.items()})
        stage1 = dict(full.config.metadata["calibration"]["stage1"])
        stage1.update(rank_requested=rank, rank=lr_config.rank, train_fit=report,
                      full_rank_train_fit=stage1["train_fit"])  # fmt: skip
        tr.config.metadata["calibration"] = {"stage1": stage1, **cfg.report}
        out.append(balance_codes(tr))
    return full, out


def balance_codes(tr: LowRankTranslator) -> LowRankTranslator:
    """Rescale each code so its encoder column and its decoder rows (over every target layer
    that reads it) have equal norms; the maps (E D) do not change. Whitened codes leave tiny
    encoders and huge decoders, and stage 2's Adam, which moves every weight by about the same
    step, then wrecks the encoders in a few steps (KL 0.48 -> 3.07 on the demo pair)."""
    c = tr.config
    for kind, rows in (("key", c.key_layers), ("value", c.value_layers)):
        p = getattr(tr, kind)
        enc, dec = np.array(p["encoder"], np.float64), np.array(p["decoder"], np.float64)
        r = enc.shape[-1]
        for s in sorted({s for row in rows for s in row}):
            reads = [(t, j) for t, row in enumerate(rows) for j, x in enumerate(row) if x == s]
            d_norm = np.sqrt(sum((dec[t, j * r : (j + 1) * r] ** 2).sum(-1) for t, j in reads))
            e_norm = np.linalg.norm(enc[s], axis=0)
            scale = np.where(
                (e_norm > 0) & (d_norm > 0), np.sqrt(d_norm / np.maximum(e_norm, 1e-300)), 1.0
            )
            enc[s] *= scale
            for t, j in reads:
                dec[t, j * r : (j + 1) * r] /= scale[:, None]
        dtype = p["encoder"].dtype
        p.update(encoder=mx.array(enc).astype(dtype), decoder=mx.array(dec).astype(dtype))
    return tr


def _clamp(config: TranslatorConfig, rank: int) -> int:
    """Ranks above the wider of the source's K and V widths store the same maps: clamp."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive integer, not {rank!r:.40}")
    s = config.source
    return min(rank, s.kv_heads * max(s.head_dim, s.value_dim))


def _sqrt_pair(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A^(1/2) and its pseudo-inverse for a symmetric positive semi-definite A."""
    vals, vecs = np.linalg.eigh((a + a.T) / 2)
    keep = vals > max(vals.max(), 0.0) * 1e-12
    root = np.sqrt(np.where(keep, vals, 0.0))
    inv = np.where(keep, 1.0 / np.where(keep, root, 1.0), 0.0)
    return (vecs * root) @ vecs.T, (vecs * inv) @ vecs.T


def factor(rows, moments: Moments, kind: str, source_layers: int, rank: int, cfg: Stage1Config):
    """Encoders (Ls, d_s, r), decoders (Lt, nu*r, d_t), biases (Lt, d_t) for `kind`.

    rows[t]: the source layers target layer t reads; `moments` holds each (kind, t, rows[t])
    problem, as the full-rank fit accumulates them.
    """
    problems = [moments.problem(kind, t, r) for t, r in enumerate(rows)]
    full = []  # per target layer: centered (Cxx, Cxy), lam, full-rank ridge W
    for xtx, xty, sx, sy, _yy, n in problems:
        cxx, cxy = centered(xtx, xty, sx, sy, n, cfg.bias)
        w, _ = ridge(xtx, xty, sx, sy, n, cfg.alpha, cfg.bias)
        full.append((cxx, cxy, ridge_lambda(cxx, cfg.alpha), w))
    ds = full[0][0].shape[0] // len(rows[0])
    encoders = np.zeros((source_layers, ds, rank))
    for s in sorted({s for r in rows for s in r}):
        blocks, cov = [], None
        for (cxx, _, _, w), r in zip(full, rows):
            for j, layer in enumerate(r):
                if layer == s:
                    blocks.append(w[j * ds : (j + 1) * ds])
                    cov = cxx[j * ds : (j + 1) * ds, j * ds : (j + 1) * ds]
        root, inv_root = _sqrt_pair(cov + ridge_lambda(cov, cfg.alpha) * np.eye(ds))
        u = np.linalg.svd(root @ np.concatenate(blocks, axis=1), full_matrices=False)[0]
        encoders[s, :, : min(rank, u.shape[1])] = inv_root @ u[:, :rank]
    decoders, biases, r2 = [], [], []
    for (cxx, cxy, lam, _), r, (xtx, xty, sx, sy, yy, n) in zip(full, rows, problems):
        e = _blockdiag([encoders[s] for s in r])
        a, c = e.T @ (cxx + lam * np.eye(len(cxx))) @ e, e.T @ cxy
        d = np.linalg.lstsq(a, c, rcond=None)[0]  # singular where a code is unused
        w = e @ d
        b = (sy - sx @ w) / n if cfg.bias else np.zeros(w.shape[1])
        sse = residual(xtx, xty, sx, sy, yy, n, w, b)
        r2.append(1 - sse / max(yy - (sy @ sy) / n, 1e-12))
        decoders.append(d)
        biases.append(b)
    params = {"encoder": encoders, "decoder": np.stack(decoders)}
    if cfg.bias:
        params["bias"] = np.stack(biases)
    return params, {"r2_mean": float(np.mean(r2)), "r2_min": float(np.min(r2))}


def _blockdiag(blocks: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)))
    i = j = 0
    for b in blocks:
        out[i : i + b.shape[0], j : j + b.shape[1]] = b
        i, j = i + b.shape[0], j + b.shape[1]
    return out
