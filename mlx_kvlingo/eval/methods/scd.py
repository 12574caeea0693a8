"""Semantic Cache Distillation (SCD), its REUSE path: a low-rank code per layer.

Target layer t reads source layer s(t) (nearest by relative depth). On paired traces (both
models read the same tokens) stack the centred producer features X and consumer features Y
side by side, each block scaled to unit mean variance, and take the top-r right singular
vectors V = [Vx; Vy] of [X | Y]: the shared latent code is Z = X Vx + Y Vy. A ridge encoder E
maps X to Z (producer side), a ridge decoder D maps the encoded code X E back to Y (consumer
side). Online the producer ships z = (x - mu_x) E, r numbers per token and layer, and the
consumer decodes y = z D + mu_y. Keys (RoPE-free, after k_norm) and values get separate
factorizations; the key rank may be lower than the value rank. Everything comes from the
streamed moments X'X, X'Y, Y'Y, so memory does not grow with the data. An SCD is a factorized
linear map: `to_translator` multiplies it out into a regular KV-Lingo translator file.

The paper's PATCH layers (a hidden-state code decoded by a trained aligner through the
target's own k_proj / v_proj at a few greedily chosen layers) are not part of this comparison.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvlingo.eval.methods import WIRE_BYTES, anchored, as_float, capture_span
from mlx_kvlingo.kv.capture import layer_features
from mlx_kvlingo.kv.translator import (
    Side,
    Translator,
    TranslatorConfig,
    nearest_layer_map,
    target_dtype,
)

import mlx.core as mx
import numpy as np
from rich.progress import Progress

KINDS = ("key", "value")


def joint_factorization(xtx, xty, yty, sx, sy, n, rank: int, alpha: float):
    """From raw moments of X (n x dx) and Y (n x dy): (mu_x, E, D, mu_y) of rank `rank`."""
    mu_x, mu_y = sx / n, sy / n
    cxx = xtx / n - np.outer(mu_x, mu_x)
    cxy = xty / n - np.outer(mu_x, mu_y)
    cyy = yty / n - np.outer(mu_y, mu_y)
    dx, dy = len(cxx), len(cyy)
    ax = max(np.trace(cxx) / dx, 1e-30)
    ay = max(np.trace(cyy) / dy, 1e-30)
    joint = np.block([[cxx / ax, cxy / np.sqrt(ax * ay)], [cxy.T / np.sqrt(ax * ay), cyy / ay]])
    _, vecs = np.linalg.eigh(joint)
    v = vecs[:, ::-1][:, :rank]
    vx, vy = v[:dx] / np.sqrt(ax), v[dx:] / np.sqrt(ay)
    e = np.linalg.solve(cxx + alpha * ax * np.eye(dx), cxx @ vx + cxy @ vy)
    g = e.T @ cxx @ e
    lam = alpha * max(np.trace(g) / rank, 1e-30)
    d = np.linalg.solve(g + lam * np.eye(rank), e.T @ cxy)
    return mu_x, e, d, mu_y


class SCD:
    name = "scd"
    key_cut = "post_norm"
    needs_hidden = ()

    def __init__(self, source: Side, target: Side, layer_map, reuse: dict,
                 native_first: bool = False):  # fmt: skip
        self.source, self.target = source, target
        self.layer_map = [int(s) for s in layer_map]  # target layer -> source layer
        self.reuse = reuse  # kind -> {"mu_x", "enc", "dec", "mu_y"} stacked over target layers
        self._index = mx.array(self.layer_map)
        self.native_first = bool(native_first)

    @property
    def ranks(self) -> tuple[int, int]:
        return self.reuse["key"]["enc"].shape[-1], self.reuse["value"]["enc"].shape[-1]

    def decode_reuse(self, x: mx.array, kind: str) -> mx.array:
        """Source features (Ls, B, H, T, D) -> target features (Lt, B, Ht, T, D') via codes."""
        f = self.reuse[kind]
        x = as_float(x)[self._index]
        Lt, B, H, T, D = x.shape
        x = x.transpose(0, 1, 3, 2, 4).reshape(Lt, B * T, H * D).astype(f["enc"].dtype)
        code = (x - f["mu_x"][:, None]) @ f["enc"]
        y = code @ f["dec"] + f["mu_y"][:, None]
        return y.reshape(Lt, B, T, self.target.kv_heads, -1).transpose(0, 1, 3, 2, 4)

    def translate(self, span, target):
        if Side.of(target.geometry) != self.target:
            raise ValueError(f"SCD made for a target {self.target}, model has {target.geometry}")
        keys = self.decode_reuse(span.keys, "key").astype(mx.float32)
        values = self.decode_reuse(span.values, "value")
        L, B, H, T, D = keys.shape
        keys = target.rope(keys.reshape(L * B, H, T, D), offset=span.start).reshape(L, B, H, T, D)
        dtype = target_dtype(target)
        keys, values = [k.astype(dtype) for k in keys], [v.astype(dtype) for v in values]
        return anchored(keys, values, span, target, self.native_first)

    def label(self) -> str:
        rk, rv = self.ranks
        return f"scd r_k={rk} r_v={rv}"

    def wire_bytes_per_token(self) -> float:
        rk, rv = self.ranks
        return self.target.layers * (rk + rv) * WIRE_BYTES

    def code_size_per_token(self) -> dict:
        """Numbers shipped per token: the codes of one layer, and of all of them."""
        rk, rv = self.ranks
        return {"reuse_per_layer": rk + rv, "total": self.target.layers * (rk + rv)}

    def nbytes(self) -> int:
        return sum(v.nbytes for kind in KINDS for v in self.reuse[kind].values())

    def to_translator(self) -> Translator:
        """The factors multiplied out: a KV-Lingo mixing translator with bias."""
        rows = tuple((s,) for s in self.layer_map)
        config = TranslatorConfig("mixing", self.source, self.target, rows, rows, bias=True,
                                  native_first=self.native_first,
                                  metadata={"provenance": {"method": "scd-reuse",
                                            "ranks": list(self.ranks)}})  # fmt: skip
        tr = Translator(config)
        for kind in KINDS:
            f = self.reuse[kind]
            w = f["enc"] @ f["dec"]
            b = f["mu_y"] - (f["mu_x"][:, None] @ w)[:, 0]
            setattr(tr, kind, {"weight": w.astype(mx.float32), "bias": b.astype(mx.float32)})
        return tr


def _moments(pair, examples, layer_map, progress, skip: int = 0) -> dict:
    """Raw moments per kind: X'X, sum X per source layer; X'Y, Y'Y, sum Y per target layer."""
    m = {kind: {"xtx": {}, "sx": {}, "xty": [], "yty": [], "sy": []} for kind in KINDS}
    n = 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("scd: paired traces", total=len(examples))
        for ex in examples:
            tokens = list(ex.prefix) + list(ex.continuation)
            s_span = capture_span(pair.source, tokens)
            t_span = capture_span(pair.target, tokens)
            for kind in KINDS:
                xs = layer_features(s_span, kind)[:, skip:].astype(np.float64)
                ys = layer_features(t_span, kind)[:, skip:].astype(np.float64)
                a = m[kind]
                for s in sorted(set(layer_map)):
                    a["xtx"][s] = a["xtx"].get(s, 0) + xs[s].T @ xs[s]
                    a["sx"][s] = a["sx"].get(s, 0) + xs[s].sum(0)
                for t, s in enumerate(layer_map):
                    terms = (xs[s].T @ ys[t], ys[t].T @ ys[t], ys[t].sum(0))
                    for key, v in zip(("xty", "yty", "sy"), terms):
                        if len(a[key]) <= t:
                            a[key].append(v)
                        else:
                            a[key][t] = a[key][t] + v
            n += len(tokens) - skip
            bar.advance(task)
    return {"moments": m, "n": n}


def fit_reuse(pair, examples, ranks: Sequence[tuple[int | None, int | None]], alpha=1e-3,
              progress=False, native_first: bool = False) -> list[SCD]:  # fmt: skip
    """One pass over `examples`, one SCD per (key rank, value rank) in `ranks` (None: full,
    the smaller of the two widths). With `native_first`, position 0 is left out of the fit
    (the target keeps its own)."""
    src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    layer_map = [r[0] for r in nearest_layer_map(src.layers, tgt.layers, 1)]
    acc = _moments(pair, examples, layer_map, progress, skip=int(native_first))
    m, n = acc["moments"], acc["n"]
    widths = {
        "key": (src.kv_heads * src.head_dim, tgt.kv_heads * tgt.head_dim),
        "value": (src.kv_heads * src.value_dim, tgt.kv_heads * tgt.value_dim),
    }
    out = []
    for rk, rv in ranks:
        reuse = {}
        for kind, r in zip(KINDS, (rk, rv)):
            full = min(widths[kind])
            r = full if r is None else min(int(r), full)
            a, parts = m[kind], {"mu_x": [], "enc": [], "dec": [], "mu_y": []}
            for t, s in enumerate(layer_map):
                f = joint_factorization(a["xtx"][s], a["xty"][t], a["yty"][t], a["sx"][s],
                                        a["sy"][t], n, r, alpha)  # fmt: skip
                for key, v in zip(("mu_x", "enc", "dec", "mu_y"), f):
                    parts[key].append(v)
            reuse[kind] = {k: mx.array(np.stack(v).astype(np.float32)) for k, v in parts.items()}
        out.append(SCD(src, tgt, layer_map, reuse, native_first=native_first))
    return out
