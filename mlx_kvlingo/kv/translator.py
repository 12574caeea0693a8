"""The KV-Lingo translator: per target layer, one linear map for keys and one for values.

For a span of tokens, the source's RoPE-free keys and its values at the `nu` source layers
listed for target layer t are concatenated per token and mapped:

    mixing:    y_t = [x_{l1}, ..., x_{l_nu}] @ W_t + b_t         (all heads -> all heads)
    headwise:  y_{t,h} = [x_{l1,h}, ..., x_{l_nu,h}] @ W_{t,h} + b_{t,h}   (head h -> head h)

Mapped keys then get the target's own k_norm (if the translator works at the pre-norm cut)
and are rotated with the target's RoPE at their true absolute positions. All target layers
are mapped in one batched matmul; nothing loops over heads or tokens.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from dataclasses import asdict, dataclass, field

from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import SpanKV, capture_from_cache, check_cut
from mlx_kvlingo.kv.rope import rotate, rotate_sum, sum_scaled, summed_scaled

import mlx.core as mx
import mlx.nn as nn

VARIANTS = ("headwise", "mixing")


@dataclass(frozen=True)
class Side:
    """The geometry a translator was made for, on one side."""

    layers: int
    kv_heads: int
    head_dim: int
    value_dim: int

    def __post_init__(self):
        for k, v in self.as_dict().items():
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be a positive integer, not {v!r:.40}")

    @classmethod
    def of(cls, geometry) -> Side:
        return cls(geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.value_dim)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TranslatorConfig:
    variant: str
    source: Side
    target: Side
    key_layers: tuple[tuple[int, ...], ...]  # per target layer: source layers read by the key map
    value_layers: tuple[tuple[int, ...], ...]
    key_cut: str = "post_norm"
    bias: bool = False
    #: the target keeps its own K/V for position 0 (the anchor token, below): the first token is an
    #: attention sink whose K/V depend only on its id, so they are computed once, not per prompt
    native_first: bool = False
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; expected one of {VARIANTS}")
        check_cut(self.key_cut)
        if self.variant == "headwise" and self.source.kv_heads != self.target.kv_heads:
            raise ValueError(
                f"headwise translation needs equal KV head counts "
                f"(source {self.source.kv_heads}, target {self.target.kv_heads}); use 'mixing'"
            )
        for kind, lm in (("key", self.key_layers), ("value", self.value_layers)):
            if len(lm) != self.target.layers:
                raise ValueError(
                    f"{kind} layer map has {len(lm)} rows, target has {self.target.layers} layers"
                )
            if len({len(r) for r in lm}) != 1 or len(lm[0]) < 1:
                raise ValueError(f"{kind} layer map rows must all list the same nu >= 1 layers")
            bad = [s for r in lm for s in r if not 0 <= s < self.source.layers]
            if bad:
                raise ValueError(
                    f"{kind} layer map names source layer {bad[0]}, source has {self.source.layers}"
                )

    @property
    def nu_k(self) -> int:
        return len(self.key_layers[0])

    @property
    def nu_v(self) -> int:
        return len(self.value_layers[0])

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        s, t, L, H = self.source, self.target, self.target.layers, self.target.kv_heads
        shapes = {}
        for kind, nu, ds, dt in (("key", self.nu_k, s.head_dim, t.head_dim),
                                 ("value", self.nu_v, s.value_dim, t.value_dim)):  # fmt: skip
            if self.variant == "mixing":
                w, b = (L, nu * s.kv_heads * ds, H * dt), (L, H * dt)
            else:
                w, b = (L, H, nu * ds, dt), (L, H, dt)
            shapes[f"{kind}.weight"] = w
            if self.bias:
                shapes[f"{kind}.bias"] = b
        return shapes


def nearest_layer_map(source_layers: int, target_layers: int, nu: int = 1) -> list[list[int]]:
    """Default layer map: each target layer reads the nu source layers nearest in relative depth."""
    if nu > source_layers:
        raise ValueError(f"nu={nu} exceeds the source's {source_layers} layers")
    rows = []
    for t in range(target_layers):
        rel = (t + 0.5) / target_layers * source_layers - 0.5
        order = sorted(range(source_layers), key=lambda s: (abs(s - rel), s))
        rows.append(sorted(order[:nu]))
    return rows


class Translator(nn.Module):
    """Maps a source span's K/V to the target's cache layout (see module docstring)."""

    def __init__(self, config: TranslatorConfig, dtype: mx.Dtype = mx.float32):
        super().__init__()
        self.config = config
        for kind in ("key", "value"):
            params = {n.split(".")[1]: mx.zeros(shape, dtype=dtype)
                      for n, shape in config.weight_shapes().items() if n.startswith(kind)}  # fmt: skip
            setattr(self, kind, params)
        self.reading = MapReading()  # how the maps read the source (`MapReading` below)

    # -- the maps -------------------------------------------------------------------------

    def map_features(
        self, x: mx.array, kind: str, reading: MapReading | None = None, layers=None
    ) -> mx.array:
        """x: source features (Ls, B, Hs, T, D) -> mapped (Lt, B, Ht, T, D') for `kind`;
        with `layers`, x holds those source layers only (`SpanKV.layers`)."""
        terms, token_major = self.map_terms(x, kind, reading, layers)
        y = sum_scaled(False, terms)
        return y.transpose(0, 1, 3, 2, 4) if token_major else y

    def map_terms(
        self, x: mx.array, kind: str, reading: MapReading | None = None, layers=None
    ) -> tuple[list[mx.array], bool]:
        """The terms whose sum (in order) is `kind`'s mapped features, the nu products (the
        nu layers are never concatenated) and the bias, and whether they are token-major,
        (Lt, B, T, Ht, D') (mixing), rather than the cache's (Lt, B, Ht, T, D') (headwise).
        Each product reads the source by `reading`'s (default: this translator's) strategy."""
        params = self.key if kind == "key" else self.value
        layer_map = self.config.key_layers if kind == "key" else self.config.value_layers
        used, index = source_rows(tuple(map(tuple, layer_map)))
        w = params["weight"]
        Lt, nu = index.shape
        at = list(used) if layers is None else [layers.index(s) for s in used]
        x = x.astype(w.dtype)
        x = x if at == list(range(x.shape[0])) else x[mx.array(at)]
        U, B, Hs, T, D = x.shape
        strategy = (reading or self.reading).strategy(kind, B * T, w.dtype)
        if self.config.variant == "mixing":
            # one copy of the used source layers: (U, B*T, Hs*D), a token's heads side by side
            rows = x.transpose(0, 1, 3, 2, 4).reshape(U, B * T, Hs * D)
            k, Ht = Hs * D, self.config.target.kv_heads
            terms = [
                product(rows, index[:, j], w[:, j * k : (j + 1) * k], strategy).reshape(
                    Lt, B, T, Ht, -1
                )
                for j in range(nu)
            ]
            if "bias" in params:
                terms.append(params["bias"].reshape(Lt, 1, 1, Ht, -1))
            return terms, True
        # headwise: every (layer, batch, head) of x already is a (T, D) matrix; the products
        # come out as (Lt, B, H, T, D'), the cache's layout, with no copy on either side
        rows = x.reshape(U * B * Hs, T, D)
        heads = mx.arange(B * Hs).reshape(B, Hs)
        terms = [
            product(
                rows,
                index[:, j, None, None] * (B * Hs) + heads,
                w[:, None, :, j * D : (j + 1) * D],
                strategy,
            )  # fmt: skip
            for j in range(nu)
        ]
        if "bias" in params:
            terms.append(params["bias"][:, None, :, None, :])
        return terms, False

    @property
    def source_layers_read(self) -> tuple[int, ...]:
        """The source layers some map reads, ascending: all a span needs to hold."""
        c = self.config
        return tuple(sorted({s for r in (*c.key_layers, *c.value_layers) for s in r}))

    def capture(self, model, cache: list, start: int, end: int) -> SpanKV:
        """`model`'s span [start, end) from its `cache` (post_norm cut) as this translator
        reads it: the source layers it reads only, token-major where its maps read a token's
        heads side by side (mixing), so that no transposed copy is made."""
        return capture_from_cache(model, cache, start, end, self.source_layers_read,
                                  token_major=self.config.variant == "mixing")  # fmt: skip

    def __call__(self, span: SpanKV) -> tuple[mx.array, mx.array]:
        """RoPE-free translated keys and values, (Lt, B, Ht, T, D), before target-side steps."""
        return (
            self.map_features(span.keys, "key", layers=span.layers),
            self.map_features(span.values, "value", layers=span.layers),
        )

    # -- into the target's cache ----------------------------------------------------------

    def translate(self, span: SpanKV, target, chunk: int = 4096) -> tuple[list, list]:
        """Keys and values per target layer, ready for `target`'s cache: (B, Ht, T, D) in its
        dtype, its k_norm and RoPE applied; `chunk` tokens at a time."""
        if span.length > chunk:
            parts = [
                self.translate(span.sub(s, min(s + chunk, span.end)), target, chunk)
                for s in range(span.start, span.end, chunk)
            ]
            ks, vs = ([mx.concatenate(x, axis=2) for x in zip(*kind)] for kind in zip(*parts))
            return ks, vs
        self.check_target(target)
        fused = self._translate_fused(span, target)
        if fused is not None:
            return fused
        keys, values = self(span)
        return self.finish(keys, values, span, target)

    def _translate_fused(self, span: SpanKV, target) -> tuple[list, list] | None:
        """`finish(*self(span), ...)` bit for bit, with the sums, the bias, k_norm's weights
        and RoPE in one compiled pass per kind on the CPU (`rope.rotate_sum`), a mixing map's
        output never transposed into a copy; None where that pass does not apply."""
        if target_dtype(target) != mx.float32 or self.key["weight"].dtype != mx.float32:
            return None
        k_terms, k_major = self.map_terms(span.keys, "key", layers=span.layers)
        scale = None
        if self.config.key_cut == "pre_norm" and target.geometry.has_k_norm:
            norm = _one_rms_norm(target, len(self.config.key_layers))
            if norm is None:
                return None
            eps, scale = norm
            k_terms = [mx.fast.rms_norm(summed_scaled(False, *k_terms), None, eps)]
        keys = rotate_sum(target.rope, k_terms, span.start, scale, token_major=k_major)
        if keys is None:
            return None
        v_terms, v_major = self.map_terms(span.values, "value", layers=span.layers)
        values = summed_scaled(False, *v_terms) if len(v_terms) > 1 else v_terms[0]
        if self.config.native_first and span.start == 0 and span.tokens:  # both kinds alike
            keys, values = with_native_first(target, span.tokens[0], keys, values, k_major)
        keys = keys.transpose(0, 1, 3, 2, 4) if k_major else keys
        values = values.transpose(0, 1, 3, 2, 4) if v_major else values
        return list(keys), list(values)

    def finish(self, keys: mx.array, values: mx.array, span: SpanKV, target) -> tuple[list, list]:
        """The target-side steps on mapped K/V (Lt, B, Ht, T, D): k_norm (pre_norm cut), RoPE
        at the span's positions, the native first token, the target's dtype."""
        keys = keys.astype(mx.float32)
        if self.config.key_cut == "pre_norm" and target.geometry.has_k_norm:
            keys = k_norm_all(target, keys)
        Lt, B, H, T, D = keys.shape
        # one pass: RoPE reads the matmul's output where it lies (see rope.py for the CPU)
        keys = rotate(target.rope, keys.reshape(Lt * B, H, T, D), span.start)
        keys = keys.reshape(Lt, B, H, T, D)
        if self.config.native_first and span.start == 0 and span.tokens:
            keys, values = with_native_first(target, span.tokens[0], keys, values)
        dtype = target_dtype(target)  # one cast of the stacked arrays, then per-layer views
        keys = keys if keys.dtype == dtype else keys.astype(dtype)
        values = values if values.dtype == dtype else values.astype(dtype)
        return list(keys), list(values)

    def restricted(self, layers: range, source_layers: tuple[int, ...] | None = None) -> Translator:
        """The maps of target `layers` only (for a rank that owns them). With `source_layers`,
        its input is those source layers alone, in that order (what the rank is sent)."""
        c = self.config
        rows = {"key": c.key_layers[layers.start : layers.stop],
                "value": c.value_layers[layers.start : layers.stop]}  # fmt: skip
        source = c.source
        if source_layers is not None:
            where = {s: i for i, s in enumerate(source_layers)}
            rows = {k: tuple(tuple(where[s] for s in r) for r in v) for k, v in rows.items()}
            source = Side(len(source_layers), source.kv_heads, source.head_dim, source.value_dim)
        target = Side(len(layers), c.target.kv_heads, c.target.head_dim, c.target.value_dim)
        config = TranslatorConfig(
            c.variant, source, target, rows["key"], rows["value"], c.key_cut, c.bias,
            c.native_first, dict(c.metadata),
        )  # fmt: skip
        tr = Translator(config, dtype=self.key["weight"].dtype)
        tr.key = {k: v[layers.start : layers.stop] for k, v in self.key.items()}
        tr.value = {k: v[layers.start : layers.stop] for k, v in self.value.items()}
        return tr

    def check_target(self, target) -> None:
        if Side.of(target.geometry) != self.config.target:
            raise ValueError(
                f"translator targets {self.config.target}, model has {Side.of(target.geometry)}"
            )


def k_norm_all(target, keys: mx.array) -> mx.array:
    """Target layer t's k_norm on keys[t], for every t: one pass when all are RMSNorms with
    one eps (bit for bit the per-layer loop: the kernel's weight is a final product), else
    layer by layer."""
    norm = _one_rms_norm(target, keys.shape[0])
    if norm is not None:
        eps, weights = norm
        return mx.fast.rms_norm(keys, None, eps) * weights
    return mx.stack([target.attention(t).k_norm(k) for t, k in enumerate(keys)])


def _one_rms_norm(target, layers: int) -> tuple[float, mx.array] | None:
    """(eps, weights (L, 1, 1, 1, D)) when every layer's k_norm is an RMSNorm with one eps."""
    norms = [target.attention(t).k_norm for t in range(layers)]
    if all(type(n) is nn.RMSNorm for n in norms) and len({n.eps for n in norms}) == 1:
        return norms[0].eps, mx.stack([n.weight for n in norms])[:, None, None, None, :]
    return None


def target_dtype(target) -> mx.Dtype:
    return getattr(target, "dtype", mx.float32)


def identity_translator(config: TranslatorConfig) -> Translator:
    """A translator that copies layer-mapped K/V unchanged (raw transfer; needs equal geometry)."""
    s, t = config.source, config.target
    if s.kv_heads * s.head_dim != t.kv_heads * t.head_dim:
        raise ValueError("raw transfer needs equal KV widths")
    tr = Translator(config)
    for kind, nu in (("key", config.nu_k), ("value", config.nu_v)):
        shape = config.weight_shapes()[f"{kind}.weight"]
        eye = mx.eye(shape[-1])  # the first of the nu layers is copied, the others ignored
        getattr(tr, kind)["weight"] = mx.broadcast_to(
            mx.concatenate([eye] + [mx.zeros_like(eye)] * (nu - 1)), shape
        )
    return tr


# -- the anchor token (`TranslatorConfig.native_first`) -----------------------------------


def with_native_first(
    target, token: int, keys: mx.array, values: mx.array, token_major: bool = False
) -> tuple[mx.array, mx.array]:
    """Position 0 of stacked translated K/V, (L, B, H, T, D) or with `token_major` (L, B, T,
    H, D), replaced by the target's own, in place (the rest is not copied)."""
    memo = target.__dict__.setdefault("_kvlingo_first_token_kv", {})
    if token not in memo:  # the target's K/V of `token` at position 0: (L, 1, H, 1, D) float32
        cache = new_cache(target)
        target.model(mx.array([[token]]), cache=cache)
        first = [(c.keys[..., :1, :], c.values[..., :1, :]) for c in cache]
        memo[token] = [mx.stack(kind).astype(mx.float32) for kind in zip(*first)]
        mx.eval(memo[token])
    k0, v0 = memo[token]

    def put(first, rest):
        first = first.transpose(0, 1, 3, 2, 4) if token_major else first
        at = (slice(None),) * (2 if token_major else 3) + (slice(0, 1),)  # position 0
        rest[at] = mx.broadcast_to(first, (*rest.shape[:2], *first.shape[2:])).astype(rest.dtype)
        return rest

    return put(k0, keys), put(v0, values)


# -- how the maps read the source ---------------------------------------------------------
#
# rows[index] @ W_t for the source layers some target layer reads, by one of two strategies:
# `in_place` (`mx.gather_mm` reads each source layer where it lies; MLX's CPU kernel, float32
# only) or `gathered` (copy the rows per target layer, then one batched matmul).

STRATEGIES = ("in_place", "gathered")
#: token counts a measurement times; a span uses the one nearest in log scale
BUCKETS = (64, 256)
#: the rule's strategy is kept unless another is faster by more than this share
MARGIN = 0.10


def rule(dtype: mx.Dtype) -> str:
    """The strategy without a measurement: in place where MLX's kernel exists (CPU float32)."""
    return "in_place" if _in_place_applies(dtype) else "gathered"


def _in_place_applies(dtype: mx.Dtype) -> bool:
    return dtype == mx.float32 and mx.default_device() == mx.cpu


@functools.lru_cache(maxsize=64)
def source_rows(rows: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], mx.array]:
    """The source layers a layer map reads (ascending) and the map re-indexed into them, (Lt, nu)."""
    used = tuple(sorted({s for r in rows for s in r}))
    where = {s: i for i, s in enumerate(used)}
    return used, mx.array([[where[s] for s in r] for r in rows])


@dataclass
class MapReading:
    """The strategy `measure` chose per (kind, token count); else, or where it can't run, `rule`."""

    chosen: dict[tuple[str, int], str] = field(default_factory=dict)
    #: seconds per strategy per (kind, bucket), from the last measurement (for reports)
    timings: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)

    def strategy(self, kind: str, n_tokens: int, dtype: mx.Dtype) -> str:
        measured = [n for k, n in self.chosen if k == kind]
        if not measured:
            return rule(dtype)
        nearest = min(measured, key=lambda n: abs(math.log(max(n_tokens, 1) / n)))
        got = self.chosen[(kind, nearest)]
        return got if got != "in_place" or _in_place_applies(dtype) else "gathered"

    def to_dict(self) -> dict[str, str]:
        """The choices, {"key:64": "in_place", ...} (what `from_dict` takes; timings are not
        kept: they are for reports)."""
        return {f"{kind}:{n}": name for (kind, n), name in sorted(self.chosen.items())}

    @classmethod
    def from_dict(cls, data: object) -> MapReading:
        """ValueError unless `data` is what `to_dict` gives."""
        if not isinstance(data, dict):
            raise ValueError("expected {kind:tokens: strategy}")
        chosen = {}
        for k, name in data.items():
            kind, _, n = str(k).partition(":")
            ok = kind in ("key", "value") and n.isascii() and n.isdigit() and name in STRATEGIES
            if not ok:
                raise ValueError(f"not a map-reading choice: {k!r:.40}: {name!r:.40}")
            chosen[(kind, int(n))] = name
        return cls(chosen)


def product(rows: mx.array, index: mx.array, w: mx.array, strategy: str) -> mx.array:
    """rows[index] @ w, with w broadcast over index's shape, computed by `strategy`."""
    if strategy == "in_place" and _in_place_applies(rows.dtype):
        shape = mx.broadcast_shapes(index.shape, w.shape[:-2])
        w_index = mx.arange(math.prod(w.shape[:-2])).reshape(w.shape[:-2])
        return mx.gather_mm(
            rows,
            w,
            lhs_indices=mx.broadcast_to(index, shape),
            rhs_indices=mx.broadcast_to(w_index, shape),
        )
    return rows[index] @ w


def measure(translator, n_tokens=BUCKETS, rounds: int = 2) -> MapReading:
    """Time each strategy on random source K/V of the translator's shapes (batch 1) and keep
    the fastest per kind and token count in `translator.reading` (empty for a translator
    without per-layer weight maps). Returns that reading."""
    reading = MapReading()
    if "weight" not in getattr(translator, "key", {}):
        return reading
    s = translator.config.source
    dtype = translator.key["weight"].dtype
    for n in n_tokens:
        for kind, width in (("key", s.head_dim), ("value", s.value_dim)):
            x = mx.random.normal((s.layers, 1, s.kv_heads, n, width)).astype(dtype)
            mx.eval(x)
            times = {}
            for name in STRATEGIES if _in_place_applies(dtype) else ("gathered",):
                one = MapReading({(kind, n): name})
                mx.eval(translator.map_features(x, kind, reading=one))  # first call: allocations
                times[name] = math.inf
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    mx.eval(translator.map_features(x, kind, reading=one))
                    times[name] = min(times[name], time.perf_counter() - t0)
            reading.timings[(kind, n)] = times
            reading.chosen[(kind, n)] = pick(times, rule(dtype))
    translator.reading = reading
    return reading


def pick(times: dict[str, float], default: str) -> str:
    """The fastest strategy, but `default` unless the fastest beats it by more than MARGIN."""
    fastest = min(times, key=times.get)
    if default in times and times[fastest] > (1 - MARGIN) * times[default]:
        return default
    return fastest


# -- into a cache -------------------------------------------------------------------------


def append_translation(model, translator: Translator, span: SpanKV, cache: list) -> None:
    """Translate `span` for `model` and append it to `model`'s `cache`, which must end where
    the span starts (positions [start, end) of the cache)."""
    if cache[0].offset != span.start:
        raise ValueError(
            f"{model.name} cache holds {cache[0].offset} tokens but the span starts at {span.start}"
        )
    append_kv(cache, *translator.translate(span, model))


def reserve_translation_memory(model, translator: Translator, n_tokens: int = 1024) -> bool:
    """On the CPU backend, translate a random span of `n_tokens` into a scratch cache of
    `model` and free both to malloc (which `cpu_memory.tune` keeps mapped), so that the first
    translation of any length up to `n_tokens` costs what a repeat costs. Returns whether it
    ran; off the CPU it does nothing."""
    if mx.default_device() != mx.cpu or n_tokens < 1:
        return False
    side = translator.config.source
    keys = mx.random.normal((side.layers, 1, side.kv_heads, n_tokens, side.head_dim))
    values = mx.random.normal((side.layers, 1, side.kv_heads, n_tokens, side.value_dim))
    cache = new_cache(model)
    append_kv(cache, *translator.translate(SpanKV(keys, values, start=0), model))  # evaluated
    del cache, keys, values
    mx.clear_cache()  # MLX's cache reuses a buffer for nearly its size only; malloc for any
    return True
