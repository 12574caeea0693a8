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
import numbers
from dataclasses import dataclass, field

from mlx_kvlingo.kv.anchor import with_native_first
from mlx_kvlingo.kv.capture import SpanKV, check_cut
from mlx_kvlingo.kv.map_reading import MapReading, SourceRows, product
from mlx_kvlingo.kv.rope import rotate, rotate_sum

import mlx.core as mx
import mlx.nn as nn

VARIANTS = ("headwise", "mixing", "lowrank")  # lowrank: see lowrank.py


@dataclass(frozen=True)
class Side:
    """The geometry a translator was made for, on one side."""

    layers: int
    kv_heads: int
    head_dim: int
    value_dim: int

    def __post_init__(self):
        for k in ("layers", "kv_heads", "head_dim", "value_dim"):
            v = getattr(self, k)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be a positive integer, not {v!r:.40}")

    @classmethod
    def of(cls, geometry) -> Side:
        return cls(geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.value_dim)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("layers", "kv_heads", "head_dim", "value_dim")}


@dataclass(frozen=True)
class TranslatorConfig:
    variant: str
    source: Side
    target: Side
    key_layers: tuple[tuple[int, ...], ...]  # per target layer: source layers read by the key map
    value_layers: tuple[tuple[int, ...], ...]
    key_cut: str = "post_norm"
    bias: bool = False
    #: the target keeps its own K/V for position 0 (see `anchor.py`): the first token is an
    #: attention sink whose K/V depend only on its id, so they are computed once, not per prompt
    native_first: bool = False
    metadata: dict = field(default_factory=dict, compare=False)
    #: lowrank only: code width per source layer (clamped to each source layer's K/V width)
    rank: int | None = None

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; expected one of {VARIANTS}")
        if self.variant == "lowrank":
            r = self.rank
            if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 1:
                raise ValueError(
                    f"a lowrank translator needs a positive integer rank, not {r!r:.40}"
                )
        elif self.rank is not None:
            raise ValueError(f"rank applies to the lowrank variant only, not {self.variant!r}")
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

    def code_width(self, kind: str) -> int:
        """lowrank: the code width per source layer, `rank` clamped to the layer's K or V width
        (a wider code cannot carry more: the full-width encoder is already invertible)."""
        width = self.source.head_dim if kind == "key" else self.source.value_dim
        return min(self.rank, self.source.kv_heads * width)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        s, t, L = self.source, self.target, self.target.layers
        if self.variant == "lowrank":  # shared encoder per source layer, decoder per target layer
            shapes = {}
            for kind, nu, ds, dt in (("key", self.nu_k, s.head_dim, t.head_dim),
                                     ("value", self.nu_v, s.value_dim, t.value_dim)):  # fmt: skip
                r = self.code_width(kind)
                shapes[f"{kind}.encoder"] = (s.layers, s.kv_heads * ds, r)
                shapes[f"{kind}.decoder"] = (L, nu * r, t.kv_heads * dt)
                if self.bias:
                    shapes[f"{kind}.bias"] = (L, t.kv_heads * dt)
        elif self.variant == "mixing":
            shapes = {
                "key.weight": (L, self.nu_k * s.kv_heads * s.head_dim, t.kv_heads * t.head_dim),
                "value.weight": (L, self.nu_v * s.kv_heads * s.value_dim, t.kv_heads * t.value_dim),
            }
            if self.bias:
                shapes["key.bias"] = (L, t.kv_heads * t.head_dim)
                shapes["value.bias"] = (L, t.kv_heads * t.value_dim)
        else:
            H = t.kv_heads
            shapes = {
                "key.weight": (L, H, self.nu_k * s.head_dim, t.head_dim),
                "value.weight": (L, H, self.nu_v * s.value_dim, t.value_dim),
            }
            if self.bias:
                shapes["key.bias"] = (L, H, t.head_dim)
                shapes["value.bias"] = (L, H, t.value_dim)
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
    """Maps a source span's K/V to the target's cache layout (see module docstring).

    A variant with maps of another shape subclasses it (`lowrank.LowRankTranslator`), naming
    its variants in `VARIANTS` and overriding `map_features` (and `_translate_fused`, the CPU
    pass for these maps); `lowrank.new_translator` picks the class for a config."""

    VARIANTS = ("headwise", "mixing")

    def __init__(self, config: TranslatorConfig, dtype: mx.Dtype = mx.float32):
        if config.variant not in self.VARIANTS:
            raise ValueError(
                f"{type(self).__name__} takes the {'/'.join(self.VARIANTS)} variants, not "
                f"{config.variant!r} (lowrank.new_translator picks the class)"
            )
        super().__init__()
        self.config = config
        shapes = config.weight_shapes()
        self.key = {"weight": mx.zeros(shapes["key.weight"], dtype=dtype)}
        self.value = {"weight": mx.zeros(shapes["value.weight"], dtype=dtype)}
        if config.bias:
            self.key["bias"] = mx.zeros(shapes["key.bias"], dtype=dtype)
            self.value["bias"] = mx.zeros(shapes["value.bias"], dtype=dtype)
        self._key_index = mx.array(config.key_layers)
        self._value_index = mx.array(config.value_layers)
        self.reading = MapReading()  # how the maps read the source (map_reading.py)
        self.__dict__["_rows_cache"] = {}  # kind -> (index, SourceRows); not a parameter

    # -- the maps -------------------------------------------------------------------------

    def map_features(self, x: mx.array, kind: str, reading: MapReading | None = None) -> mx.array:
        """x: source features (Ls, B, Hs, T, D) -> mapped (Lt, B, Ht, T, D') for `kind`."""
        terms, token_major = self.map_terms(x, kind, reading)
        y = _sum_of(terms)
        return y.transpose(0, 1, 3, 2, 4) if token_major else y

    def map_terms(
        self, x: mx.array, kind: str, reading: MapReading | None = None
    ) -> tuple[list[mx.array], bool]:
        """The terms whose sum (in order) is `kind`'s mapped features: the nu products and
        the bias, and whether they are token-major, (Lt, B, T, Ht, D') (mixing), rather than
        the cache's (Lt, B, Ht, T, D') (headwise). All are views of the products, no copy.

        A map reading nu layers is the sum of nu products, so the nu layers are never
        concatenated; only the source layers some target layer reads are touched, and how
        each product reads them is `reading`'s (default: this translator's) strategy."""
        params = self.key if kind == "key" else self.value
        source = self._source_rows(kind)
        w = params["weight"]
        Lt, nu = source.index.shape
        x = source.select(x.astype(w.dtype))
        U, B, Hs, T, D = x.shape
        strategy = (reading or self.reading).strategy(kind, B * T, w.dtype)
        if self.config.variant == "mixing":
            # one copy of the used source layers: (U, B*T, Hs*D), a token's heads side by side
            rows = x.transpose(0, 1, 3, 2, 4).reshape(U, B * T, Hs * D)
            k, Ht = Hs * D, self.config.target.kv_heads
            terms = [
                product(rows, source.index[:, j], w[:, j * k : (j + 1) * k], strategy).reshape(
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
                source.index[:, j, None, None] * (B * Hs) + heads,
                w[:, None, :, j * D : (j + 1) * D],
                strategy,
            )  # fmt: skip
            for j in range(nu)
        ]
        if "bias" in params:
            terms.append(params["bias"][:, None, :, None, :])
        return terms, False

    def _source_rows(self, kind: str) -> SourceRows:
        """The source layers `kind`'s map reads, from its index (cached while it is the same)."""
        index = self._key_index if kind == "key" else self._value_index
        cached = self._rows_cache.get(kind)
        if cached is None or cached[0] is not index:
            rows = tuple(tuple(r) for r in index.tolist())
            cached = self._rows_cache[kind] = (
                index,
                SourceRows.of(rows, self.config.source.layers),
            )
        return cached[1]

    def __call__(self, span: SpanKV) -> tuple[mx.array, mx.array]:
        """RoPE-free translated keys and values, (Lt, B, Ht, T, D), before target-side steps."""
        return self.map_features(span.keys, "key"), self.map_features(span.values, "value")

    # -- into the target's cache ----------------------------------------------------------

    def translate(self, span: SpanKV, target, chunk: int = 4096) -> tuple[list, list]:
        """Keys and values per target layer, ready for its cache: (B, Ht, T, D) in its dtype.

        `target` is the LoadedModel whose k_norm and RoPE finish the keys. Long spans are
        processed in chunks of `chunk` tokens to bound memory.
        """
        if span.length > chunk:
            parts = [
                self.translate(
                    SpanKV(
                        span.keys[..., s : s + chunk, :],
                        span.values[..., s : s + chunk, :],
                        span.start + s,
                        span.tokens[s : s + chunk] if span.tokens else None,
                    ),
                    target,
                    chunk,
                )
                for s in range(0, span.length, chunk)
            ]
            ks = [mx.concatenate([p[0][i] for p in parts], axis=2) for i in range(len(parts[0][0]))]
            vs = [mx.concatenate([p[1][i] for p in parts], axis=2) for i in range(len(parts[0][1]))]
            return ks, vs
        self.check_target(target)
        fused = self._translate_fused(span, target)
        if fused is not None:
            return fused
        keys, values = self(span)
        return self.finish(keys, values, span, target)

    def _translate_fused(self, span: SpanKV, target) -> tuple[list, list] | None:
        """`finish(*self(span), ...)` bit for bit, with the sums, the bias, k_norm's weights
        and RoPE in one compiled pass per kind on the CPU (rope.rotate_sum) and a mixing
        map's output never transposed into a copy: the cache writes read it where it lies.
        None where that pass does not apply (another backend, dtype or RoPE; k_norms that are
        not one RMSNorm). A native first token is written over position 0 in place
        (`with_native_first`)."""
        if target_dtype(target) != mx.float32 or self.key["weight"].dtype != mx.float32:
            return None
        k_terms, k_major = self.map_terms(span.keys, "key")
        scale = None
        if self.config.key_cut == "pre_norm" and target.geometry.has_k_norm:
            norm = _one_rms_norm(target, len(self.config.key_layers))
            if norm is None:
                return None
            eps, scale = norm
            k_terms = [mx.fast.rms_norm(_summed(*k_terms), None, eps)]
        keys = rotate_sum(target.rope, k_terms, span.start, scale, token_major=k_major)
        if keys is None:
            return None
        v_terms, v_major = self.map_terms(span.values, "value")
        values = _summed(*v_terms) if len(v_terms) > 1 else v_terms[0]
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
    norms = [target.attention(t).k_norm for t in range(keys.shape[0])]
    return mx.stack([norm(k) for norm, k in zip(norms, keys, strict=True)])


def _one_rms_norm(target, layers: int) -> tuple[float, mx.array] | None:
    """(eps, weights (L, 1, 1, 1, D)) when every layer's k_norm is an RMSNorm with one eps."""
    norms = [target.attention(t).k_norm for t in range(layers)]
    if all(type(n) is nn.RMSNorm for n in norms) and len({n.eps for n in norms}) == 1:
        return norms[0].eps, mx.stack([n.weight for n in norms])[:, None, None, None, :]
    return None


@functools.partial(mx.compile, shapeless=True)
def _summed(*terms):
    """`_sum_of(terms)` in one compiled pass on the CPU: the same adds, in order."""
    return _sum_of(terms)


def _sum_of(terms):
    total = None
    for t in terms:
        total = t if total is None else total + t
    return total


def target_dtype(target) -> mx.Dtype:
    return getattr(target, "dtype", mx.float32)


def identity_translator(config: TranslatorConfig) -> Translator:
    """A translator that copies layer-mapped K/V unchanged (raw transfer; needs equal geometry)."""
    if (
        config.source.kv_heads * config.source.head_dim
        != config.target.kv_heads * config.target.head_dim
    ):
        raise ValueError("raw transfer needs equal KV widths")
    tr = Translator(config)
    shapes = config.weight_shapes()
    for kind, nu in (("key", config.nu_k), ("value", config.nu_v)):
        shape = shapes[f"{kind}.weight"]
        eye = mx.eye(shape[-1])  # the first of the nu layers is copied, the others ignored
        getattr(tr, kind)["weight"] = mx.broadcast_to(
            mx.concatenate([eye] + [mx.zeros_like(eye)] * (nu - 1)), shape
        )
    return tr
