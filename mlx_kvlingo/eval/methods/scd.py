"""Semantic Cache Distillation (SCD): a low-rank code per layer, and a few patched layers.

REUSE (most layers). Target layer t reads source layer s(t) (nearest by relative depth). On
paired traces (both models read the same tokens) stack the centred producer features X and
consumer features Y side by side, each block scaled to unit mean variance, and take the top-r
right singular vectors V = [Vx; Vy] of [X | Y]: the shared latent code is Z = X Vx + Y Vy.
A ridge encoder E maps X to Z (producer side), a ridge decoder D maps the encoded code X E
back to Y (consumer side). Online the producer ships z = (x - mu_x) E, r numbers per token
and layer, and the consumer decodes y = z D + mu_y. Keys (RoPE-free, after k_norm) and
values get separate factorizations; the key rank may be lower than the value rank. Everything
comes from the streamed moments X'X, X'Y, Y'Y, so memory does not grow with the data. A
REUSE-only SCD is a factorized linear map: `to_translator` multiplies it out into a regular
KV-Lingo translator file.

PATCH (a few transition layers). At patch layer t the producer ships a PCA code of its own
pre-attention normalized hidden state at layer s(t) (`input_layernorm` output). The
consumer's aligner, a linear map plus a small residual MLP trained with an L2 feature-matching
loss against the target's own normalized hidden state at layer t, reconstructs that state, and
the target's own k_proj / v_proj (+ k_norm, RoPE) regenerate native K and V from it.

Patch layers are chosen once, at calibration: a restore-one pass (each layer's K/V replaced by
the target's native K/V, one at a time) measures each layer's sensitivity and keeps the best
as a candidate pool; aligners are trained for the pool; then `greedy_select` adds, one at a
time, the layer with the largest quality gain per unit cost, re-measuring the quality of the
whole set each round (so redundant layers stop paying off). Quality is -KL(native || SCD) on
calibration examples.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mlx_kvlingo.eval.methods import (
    WIRE_BYTES,
    anchored,
    as_float,
    capture_span,
    side_meta,
    write_method_file,
)
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import layer_features
from mlx_kvlingo.kv.scoring import kl
from mlx_kvlingo.kv.translator import (
    Side,
    Translator,
    TranslatorConfig,
    nearest_layer_map,
    target_dtype,
)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from rich.progress import Progress

KINDS = ("key", "value")


@dataclass
class ScdConfig:
    key_rank: int | None = None  # None: full (the smaller of the two widths)
    value_rank: int | None = None
    patches: int = 0  # patch layers to select (0: REUSE only)
    pool: int = 6  # candidate pool from the restore-one pass
    budget: float | None = None  # total patch cost allowed (bytes per token), None: no limit
    hidden_rank: int | None = None  # patch code size; None: a quarter of the source width
    mlp_hidden: int = 128
    steps: int = 300  # aligner training steps
    batch: int = 256
    lr: float = 1e-3
    alpha: float = 1e-3  # ridge, relative to the mean input variance
    select_examples: int = 8  # calibration examples for the quality oracle
    max_tokens: int = 4096  # hidden-state samples (tokens) for aligner training
    native_first: bool = False  # position 0 keeps the target's own K/V; fitted without it
    seed: int = 0


# -- the pure parts: factorization and selection ---------------------------------------------


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


def restore_one_pool(
    layers: Sequence[int], quality: Callable[[frozenset], float], size: int, min_gain: float = 0.0
) -> tuple[list[int], dict[int, float]]:
    """Each layer's gain when it alone is restored; the `size` best with gain > min_gain."""
    base = quality(frozenset())
    gains = {layer: quality(frozenset([layer])) - base for layer in layers}
    ranked = sorted((g for g in layers if gains[g] > min_gain), key=lambda g: (-gains[g], g))
    return ranked[:size], gains


def greedy_select(
    candidates: Sequence[int],
    quality: Callable[[frozenset], float],
    cost: Callable[[int], float] = lambda layer: 1.0,
    max_layers: int | None = None,
    budget: float | None = None,
    min_gain: float = 0.0,
) -> tuple[list[int], list[dict]]:
    """Add layers one at a time, each round the one with the largest gain per unit cost,
    where gain = quality(chosen + layer) - quality(chosen) is measured on the whole set
    (interactions count). Stops at `max_layers`, at the cost `budget`, or when no layer gains
    more than `min_gain`. Ties go to the earlier candidate. Returns (chosen, history)."""
    quality = functools.lru_cache(maxsize=None)(quality)
    chosen: list[int] = []
    spent, current = 0.0, quality(frozenset())
    history = [{"layers": [], "quality": current, "cost": 0.0}]
    while max_layers is None or len(chosen) < max_layers:
        best = None
        for layer in candidates:
            c = cost(layer)
            if layer in chosen or (budget is not None and spent + c > budget * (1 + 1e-12)):
                continue
            gain = quality(frozenset([*chosen, layer])) - current
            if gain > min_gain and (best is None or gain / c > best[0]):
                best = (gain / c, layer, gain, c)
        if best is None:
            break
        _, layer, gain, c = best
        chosen.append(layer)
        spent += c
        current += gain
        history.append({"layers": list(chosen), "quality": current, "cost": spent, "gain": gain})
    return chosen, history


# -- the patch aligner -----------------------------------------------------------------------


class Aligner(nn.Module):
    """code (r) -> hidden state (d): a linear map plus a residual MLP (zero at init)."""

    def __init__(self, rank: int, dim: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(rank, dim)
        self.up = nn.Linear(rank, hidden)
        self.down = nn.Linear(hidden, dim)
        self.down.weight = mx.zeros_like(self.down.weight)
        self.down.bias = mx.zeros_like(self.down.bias)

    def __call__(self, code: mx.array) -> mx.array:
        return self.linear(code) + self.down(nn.gelu(self.up(code)))


@dataclass
class Patch:
    """Producer: code = (h_s - mu) @ basis. Consumer: aligner(code) -> h_t."""

    source_layer: int
    mu: mx.array
    basis: mx.array
    aligner: Aligner
    report: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    def encode(self, h: mx.array) -> mx.array:
        return (h.astype(mx.float32) - self.mu) @ self.basis

    def __call__(self, h: mx.array) -> mx.array:
        return self.aligner(self.encode(h))

    def tensors(self, prefix: str) -> dict:
        out = {f"{prefix}.mu": self.mu, f"{prefix}.basis": self.basis}
        out |= {f"{prefix}.aligner.{k}": v for k, v in tree_flatten(self.aligner.parameters())}
        return out

    @classmethod
    def from_tensors(cls, tensors: dict, prefix: str, source_layer: int, report=None) -> Patch:
        mu, basis = tensors[f"{prefix}.mu"], tensors[f"{prefix}.basis"]
        w = tensors[f"{prefix}.aligner.up.weight"]
        dim = tensors[f"{prefix}.aligner.linear.weight"].shape[0]
        aligner = Aligner(basis.shape[1], dim, w.shape[0])
        p = f"{prefix}.aligner."
        aligner.update(
            tree_unflatten([(k[len(p) :], v) for k, v in tensors.items() if k.startswith(p)])
        )
        return cls(source_layer, mu, basis, aligner, report or {})


def regenerate(target, layer: int, h: mx.array, start: int) -> tuple[mx.array, mx.array]:
    """Native-style K/V of `layer` from a normalized hidden state h (B, T, d), via the target's
    own k_proj / v_proj, k_norm and RoPE."""
    attn = target.attention(layer)
    g = target.geometry
    B, T, _ = h.shape
    h = h.astype(target_dtype(target))
    k = attn.k_proj(h).reshape(B, T, g.kv_heads, g.head_dim)
    if g.has_k_norm:
        k = attn.k_norm(k)
    k = attn.rope(k.transpose(0, 2, 1, 3), offset=start)
    v = attn.v_proj(h).reshape(B, T, g.kv_heads, g.value_dim).transpose(0, 2, 1, 3)
    return k, v


# -- the method ------------------------------------------------------------------------------


class SCD:
    name = "scd"
    key_cut = "post_norm"

    def __init__(
        self, source: Side, target: Side, layer_map, reuse: dict, patches=None, meta=None,
        native_first: bool = False,
    ):  # fmt: skip
        self.source, self.target = source, target
        self.layer_map = [int(s) for s in layer_map]  # target layer -> source layer
        self.reuse = reuse  # kind -> {"mu_x", "enc", "dec", "mu_y"} stacked over target layers
        self.patches: dict[int, Patch] = dict(patches or {})
        self.meta = dict(meta or {})
        self._index = mx.array(self.layer_map)
        self.native_first = bool(native_first)

    @property
    def ranks(self) -> tuple[int, int]:
        return self.reuse["key"]["enc"].shape[-1], self.reuse["value"]["enc"].shape[-1]

    @property
    def needs_hidden(self) -> tuple:
        return tuple(sorted({("normed", p.source_layer) for p in self.patches.values()}))

    def with_patches(self, layers: Sequence[int]) -> SCD:
        """The same REUSE factors with only `layers` patched (they must have aligners here)."""
        return SCD(self.source, self.target, self.layer_map, self.reuse,
                   {t: self.patches[t] for t in layers}, self.meta, self.native_first)  # fmt: skip

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
        for t, p in self.patches.items():
            k, v = regenerate(target, t, p(span.hidden[("normed", p.source_layer)]), span.start)
            keys[t], values[t] = k.astype(dtype), v.astype(dtype)
        return anchored(keys, values, span, target, self.native_first)

    def label(self) -> str:
        rk, rv = self.ranks
        s = f"scd r_k={rk} r_v={rv}"
        if self.patches:
            s += f" patch {len(self.patches)} ({','.join(map(str, sorted(self.patches)))})"
        return s

    def wire_bytes_per_token(self) -> float:
        rk, rv = self.ranks
        reused = self.target.layers - len(self.patches)
        return (reused * (rk + rv) + sum(p.rank for p in self.patches.values())) * WIRE_BYTES

    def code_size_per_token(self) -> dict:
        """Numbers shipped per token: REUSE codes per layer, PATCH codes per patched layer."""
        rk, rv = self.ranks
        return {"reuse_per_layer": rk + rv, "patch": {t: p.rank for t, p in self.patches.items()},
                "total": self.wire_bytes_per_token() / WIRE_BYTES}  # fmt: skip

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.tensors().values())

    def tensors(self) -> dict:
        out = {f"reuse.{kind}.{k}": v for kind in KINDS for k, v in self.reuse[kind].items()}
        for t, p in self.patches.items():
            out |= p.tensors(f"patch.{t}")
        return out

    def state(self, pair=None) -> tuple[dict, dict]:
        meta = {
            "method": "scd", "source_side": self.source.as_dict(), "target_side": self.target.as_dict(),
            "layer_map": self.layer_map, "ranks": {"key": self.ranks[0], "value": self.ranks[1]},
            "patches": {str(t): {"source_layer": p.source_layer, "rank": p.rank, "report": p.report}
                        for t, p in self.patches.items()},
            "code_size_per_token": self.code_size_per_token(), "native_first": self.native_first,
            **self.meta,
        }  # fmt: skip
        if pair is not None:
            meta |= {"source": side_meta(pair.source), "target": side_meta(pair.target)}
        return self.tensors(), meta

    def save(self, path, pair=None) -> Path:
        return write_method_file(path, *self.state(pair))

    @classmethod
    def from_state(cls, tensors: dict, meta: dict) -> SCD:
        reuse = {
            kind: {k: tensors[f"reuse.{kind}.{k}"] for k in ("mu_x", "enc", "dec", "mu_y")}
            for kind in KINDS
        }
        patches = {
            int(t): Patch.from_tensors(tensors, f"patch.{t}", p["source_layer"], p.get("report"))
            for t, p in meta["patches"].items()
        }
        skip = {"method", "source_side", "target_side", "layer_map", "ranks", "patches",
                "code_size_per_token", "source", "target", "schema", "schema_version",
                "native_first"}  # fmt: skip
        return cls(Side(**meta["source_side"]), Side(**meta["target_side"]), meta["layer_map"],
                   reuse, patches, {k: v for k, v in meta.items() if k not in skip},
                   meta.get("native_first", False))  # fmt: skip

    def to_translator(self) -> Translator:
        """REUSE multiplied out: a KV-Lingo mixing translator with bias (no patches allowed)."""
        if self.patches:
            raise ValueError("only a REUSE-only SCD is a linear map; drop the patches first")
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


# -- calibration -----------------------------------------------------------------------------


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
    """One pass over `examples`, one REUSE-only SCD per (key rank, value rank) in `ranks`.
    With `native_first`, position 0 is left out of the fit (the target keeps its own)."""
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
        meta = {"calibration": {"reuse": {"examples": len(examples), "tokens": n, "alpha": alpha}}}
        out.append(SCD(src, tgt, layer_map, reuse, meta=meta, native_first=native_first))
    return out


def _hidden_samples(pair, examples, pairs: Sequence[tuple[int, int]], cfg: ScdConfig):
    """For (target layer, source layer) pairs: normalized hidden states of both, subsampled."""
    s_points = [("normed", s) for _, s in pairs]
    t_points = [("normed", t) for t, _ in pairs]
    hs = {p: [] for p in pairs}
    ht = {p: [] for p in pairs}
    seen = 0
    for ex in examples:
        if seen >= cfg.max_tokens:
            break
        tokens = list(ex.prefix) + list(ex.continuation)
        seen += len(tokens)
        a = capture_span(pair.source, tokens, points=s_points).hidden
        b = capture_span(pair.target, tokens, points=t_points).hidden
        skip = int(cfg.native_first)  # position 0 keeps the target's own K/V: not trained on
        for t, s in pairs:
            hs[t, s].append(np.array(a["normed", s][0, skip:].astype(mx.float32)))
            ht[t, s].append(np.array(b["normed", t][0, skip:].astype(mx.float32)))
    rng = np.random.default_rng(cfg.seed)
    out = {}
    for p in pairs:
        x, y = np.concatenate(hs[p]), np.concatenate(ht[p])
        if len(x) > cfg.max_tokens:
            keep = rng.choice(len(x), cfg.max_tokens, replace=False)
            x, y = x[keep], y[keep]
        out[p] = (x, y)
    return out


def train_patch(x: np.ndarray, y: np.ndarray, source_layer: int, cfg: ScdConfig) -> Patch:
    """PCA code of the producer's state, ridge-initialized aligner, then L2 feature matching."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    mu = x64.mean(0)
    xc = x64 - mu
    rank = cfg.hidden_rank or max(1, x.shape[1] // 4)
    rank = min(rank, x.shape[1])
    _, vecs = np.linalg.eigh(xc.T @ xc)
    basis = vecs[:, ::-1][:, :rank]
    code = xc @ basis
    cc = code.T @ code
    lam = cfg.alpha * max(np.trace(cc) / rank, 1e-30)
    my = y64.mean(0)
    a = np.linalg.solve(cc + lam * np.eye(rank), code.T @ (y64 - my))
    mx.random.seed(cfg.seed)
    aligner = Aligner(rank, y.shape[1], cfg.mlp_hidden)
    aligner.linear.weight = mx.array(a.T.astype(np.float32))
    aligner.linear.bias = mx.array(my.astype(np.float32))
    c_all, y_all = mx.array(code.astype(np.float32)), mx.array(y)

    def loss_fn(model, c, t):
        return ((model(c) - t) ** 2).mean()

    init_loss = loss_fn(aligner, c_all, y_all).item()
    best = (init_loss, dict(tree_flatten(aligner.parameters())))
    if cfg.steps > 0:
        opt = optim.Adam(learning_rate=cfg.lr)
        step = nn.value_and_grad(aligner, loss_fn)
        rng = np.random.default_rng(cfg.seed)
        for _ in range(cfg.steps):
            idx = mx.array(rng.integers(0, len(x), min(cfg.batch, len(x))))
            _, g = step(aligner, c_all[idx], y_all[idx])
            opt.update(aligner, g)
            mx.eval(aligner.parameters(), opt.state)
        trained = loss_fn(aligner, c_all, y_all).item()
        if trained < best[0]:
            best = (trained, dict(tree_flatten(aligner.parameters())))
    aligner.update(tree_unflatten(list(best[1].items())))
    var = float(((y64 - my) ** 2).mean())
    report = {"rank": rank, "tokens": len(x), "mse_linear": init_loss, "mse": best[0],
              "rel_mse": best[0] / max(var, 1e-30)}  # fmt: skip
    return Patch(source_layer, mx.array(mu.astype(np.float32)),
                 mx.array(basis.astype(np.float32)), aligner, report)  # fmt: skip


def _logp(pair, keys, values, inputs) -> mx.array:
    cache = new_cache(pair.target)
    for c, k, v in zip(cache, keys, values, strict=True):
        c.update_and_fetch(k, v)
    logits = pair.target.model(inputs[None], cache=cache)[0]
    return nn.log_softmax(logits.astype(mx.float32), axis=-1)


class _Oracle:
    """Quality of a layer set, -mean KL(native || composed cache), over prepared examples.

    Composes per example: REUSE K/V everywhere, and for layers in the set either the target's
    native K/V (`restore`) or the patch's regenerated K/V."""

    def __init__(self, pair, scd: SCD, examples):
        self.pair, self.items = pair, []
        s_points = [("normed", s) for s in sorted(set(scd.layer_map))]
        for ex in examples:
            prefix, cont = list(ex.prefix), list(ex.continuation)
            span = capture_span(pair.source, prefix[:-1], points=s_points)
            cache = new_cache(pair.target)
            pair.target.model(mx.array(prefix + cont[:-1])[None][:, : len(prefix) - 1], cache=cache)
            native = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
            logits = pair.target.model(mx.array(prefix + cont[:-1])[None])[0, len(prefix) - 1 :]
            teacher = nn.log_softmax(logits.astype(mx.float32), axis=-1)
            keys, values = scd.translate(span, pair.target)
            mx.eval(keys, values, native, teacher)
            self.items.append({"span": span, "native": native, "teacher": teacher,
                               "reuse": (keys, values), "patched": {},
                               "inputs": mx.array([prefix[-1]] + cont[:-1])})  # fmt: skip

    def add_patches(self, patches: dict[int, Patch], native_first: bool = False) -> None:
        for it in self.items:
            for t, p in patches.items():
                h = it["span"].hidden[("normed", p.source_layer)]
                k, v = regenerate(self.pair.target, t, p(h), it["span"].start)
                if native_first:  # position 0 stays the target's own, as in SCD.translate
                    nk, nv = it["native"][t]
                    k = mx.concatenate([nk[..., :1, :], k[..., 1:, :].astype(nk.dtype)], axis=2)
                    v = mx.concatenate([nv[..., :1, :], v[..., 1:, :].astype(nv.dtype)], axis=2)
                mx.eval(k, v)
                it["patched"][t] = (k, v)

    def quality(self, layers: frozenset, restore: bool) -> float:
        vals = []
        for it in self.items:
            keys, values = list(it["reuse"][0]), list(it["reuse"][1])
            for t in layers:
                keys[t], values[t] = it["native"][t] if restore else it["patched"][t]
            vals.append(kl(it["teacher"], _logp(self.pair, keys, values, it["inputs"])).item())
        return -float(np.mean(vals))


def select_patches(pair, scd: SCD, train, cfg: ScdConfig, progress=False) -> SCD:
    """Restore-one pool, aligners for the pool, greedy selection; returns the patched SCD with
    aligners for the whole greedy order (use `with_patches` for fewer)."""
    cfg = replace(cfg, native_first=scd.native_first)
    held = train[: cfg.select_examples]
    oracle = _Oracle(pair, scd, held)
    layers = list(range(scd.target.layers))
    pool, gains = restore_one_pool(layers, lambda s: oracle.quality(s, restore=True), cfg.pool)
    pairs = [(t, scd.layer_map[t]) for t in pool]
    samples = _hidden_samples(pair, train, pairs, cfg) if pairs else {}
    patches = {}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("scd: training aligners", total=len(pairs))
        for t, s in pairs:
            patches[t] = train_patch(*samples[t, s], s, cfg)
            bar.advance(task)
    oracle.add_patches(patches, scd.native_first)
    cost = lambda t: patches[t].rank * WIRE_BYTES  # noqa: E731 - bytes per token on the wire
    chosen, history = greedy_select(pool, lambda s: oracle.quality(s, restore=False), cost,
                                    max_layers=cfg.patches, budget=cfg.budget)  # fmt: skip
    out = scd.with_patches([])
    out.patches = {t: patches[t] for t in chosen}
    out.meta = copy.deepcopy(scd.meta)
    out.meta.setdefault("calibration", {})["patch_selection"] = {
        "quality": "-mean KL(native || scd) on calibration examples",
        "examples": len(held), "restore_one_gain": {str(k): v for k, v in gains.items()},
        "pool": pool, "order": chosen, "greedy": history, "config": asdict(cfg),
    }  # fmt: skip
    return out


def calibrate(pair, examples, cfg: ScdConfig = ScdConfig(), progress=False) -> SCD:
    """REUSE factors from paired traces; with `cfg.patches`, patch layers and their aligners."""
    ranks = [(cfg.key_rank, cfg.value_rank)]
    (scd,) = fit_reuse(pair, examples, ranks, cfg.alpha, progress, cfg.native_first)
    if cfg.patches:
        scd = select_patches(pair, scd, list(examples), cfg, progress)
    return scd
