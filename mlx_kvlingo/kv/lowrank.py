"""The low-rank translator: a shared encoder per source layer, a decoder per target layer.

For keys (RoPE-free, at the translator's cut) and, separately, for values, every source layer
s has one encoder E_s (d_s x r) that turns its per-token features into an r-number code, and
every target layer t has a decoder D_t (nu*r x d_t) that reads the codes of its nu source
layers, concatenated in layer-map order:

    y_t = [x_{l1} E_{l1}, ..., x_{l_nu} E_{l_nu}] @ D_t + b_t

so a source layer read by several target layers is encoded once. Per token and kind that is
(used source layers * d_s + Lt * nu * d_t) * r multiply-adds instead of Lt * nu * d_s * d_t:
fewer only when r is below Lt * nu * d_s * d_t / (Ls_used * d_s + Lt * nu * d_t).
The target-side steps (k_norm, RoPE, native first token, cast) are the full-rank translator's
(`Translator.finish`). The fit is `calibrate/lowrank.py`.
"""

from __future__ import annotations

from mlx_kvlingo.kv.capture import SpanKV
from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig

import mlx.core as mx
import mlx.nn as nn


class LowRankTranslator(Translator):
    """A `Translator` whose per-target-layer maps factor through shared per-source-layer codes."""

    VARIANTS = ("lowrank",)

    def __init__(self, config: TranslatorConfig, dtype: mx.Dtype = mx.float32):
        if config.variant not in self.VARIANTS:
            raise ValueError(f"LowRankTranslator needs the lowrank variant, not {config.variant!r}")
        nn.Module.__init__(self)
        self.config = config
        shapes = config.weight_shapes()
        for kind in ("key", "value"):
            params = {
                name.split(".", 1)[1]: mx.zeros(shape, dtype=dtype)
                for name, shape in shapes.items()
                if name.startswith(kind + ".")
            }
            setattr(self, kind, params)
        # encode only the source layers some target layer reads; index rows into those codes
        for kind, rows in (("key", config.key_layers), ("value", config.value_layers)):
            used = sorted({s for r in rows for s in r})
            where = {s: i for i, s in enumerate(used)}
            setattr(self, f"_{kind}_used", mx.array(used))
            setattr(self, f"_{kind}_index", mx.array([[where[s] for s in r] for r in rows]))

    def _translate_fused(self, span: SpanKV, target) -> None:
        """No fused CPU pass for factored maps: `translate` maps, then `finish`es."""
        return None

    def map_features(self, x: mx.array, kind: str) -> mx.array:
        """x: source features (Ls, B, Hs, T, D) -> mapped (Lt, B, Ht, T, D') for `kind`."""
        params = self.key if kind == "key" else self.value
        used = self._key_used if kind == "key" else self._value_used
        index = self._key_index if kind == "key" else self._value_index
        enc, dec = params["encoder"], params["decoder"]
        Lt, nu = index.shape
        _, B, Hs, T, D = x.shape
        x = x.astype(enc.dtype)[used].transpose(0, 1, 3, 2, 4).reshape(len(used), B * T, Hs * D)
        codes = x @ enc[used]  # (used, B*T, r): one code per source layer
        if nu == 1:
            z = codes[index[:, 0]]
        else:  # a target layer reading several source layers concatenates their codes
            z = codes[index.reshape(-1)].reshape(Lt, nu, B * T, -1)
            z = z.transpose(0, 2, 1, 3).reshape(Lt, B * T, -1)
        y = z @ dec
        if "bias" in params:
            y = y + params["bias"][:, None, :]
        Ht = self.config.target.kv_heads
        return y.reshape(Lt, B, T, Ht, -1).transpose(0, 1, 3, 2, 4)

    def __call__(self, span: SpanKV) -> tuple[mx.array, mx.array]:
        return self.map_features(span.keys, "key"), self.map_features(span.values, "value")

    def restricted(self, layers: range, source_layers: tuple[int, ...] | None = None):
        """The decoders of target `layers` only; with `source_layers`, the encoders of those
        source layers alone, in that order (as `Translator.restricted`)."""
        c = self.config
        rows = {"key": c.key_layers[layers.start : layers.stop],
                "value": c.value_layers[layers.start : layers.stop]}  # fmt: skip
        source, keep = c.source, list(range(c.source.layers))
        if source_layers is not None:
            where = {s: i for i, s in enumerate(source_layers)}
            rows = {k: tuple(tuple(where[s] for s in r) for r in v) for k, v in rows.items()}
            source = Side(len(source_layers), source.kv_heads, source.head_dim, source.value_dim)
            keep = list(source_layers)
        target = Side(len(layers), c.target.kv_heads, c.target.head_dim, c.target.value_dim)
        config = TranslatorConfig(
            c.variant, source, target, rows["key"], rows["value"], c.key_cut, c.bias,
            c.native_first, dict(c.metadata), rank=c.rank,
        )  # fmt: skip
        tr = LowRankTranslator(config, dtype=self.key["encoder"].dtype)
        for kind in ("key", "value"):
            p = getattr(self, kind)
            out = {"encoder": p["encoder"][mx.array(keep)]}
            out.update({k: v[layers.start : layers.stop] for k, v in p.items() if k != "encoder"})
            setattr(tr, kind, out)
        return tr

    def full_rank(self) -> Translator:
        """The same maps multiplied out: a mixing translator (for checks; slower at small r)."""
        c = self.config
        config = TranslatorConfig(
            "mixing", c.source, c.target, c.key_layers, c.value_layers, c.key_cut, c.bias,
            c.native_first, dict(c.metadata),
        )  # fmt: skip
        tr = Translator(config, dtype=self.key["encoder"].dtype)
        for kind, rows in (("key", c.key_layers), ("value", c.value_layers)):
            p = getattr(self, kind)
            r = c.code_width(kind)
            enc, dec = p["encoder"], p["decoder"]
            w = [
                mx.concatenate([enc[s] @ dec[t, j * r : (j + 1) * r] for j, s in enumerate(row)])
                for t, row in enumerate(rows)
            ]
            params = {"weight": mx.stack(w)}
            if "bias" in p:
                params["bias"] = p["bias"]
            setattr(tr, kind, params)
        return tr


def new_translator(config: TranslatorConfig, dtype: mx.Dtype = mx.float32) -> Translator:
    """A zero translator of the class `config.variant` needs."""
    cls = next(c for c in (Translator, LowRankTranslator) if config.variant in c.VARIANTS)
    return cls(config, dtype=dtype)


def multiply_adds(config: TranslatorConfig) -> int:
    """Multiply-adds per token of the maps (keys and values), for the FLOP comparison."""
    total = 0
    for name, shape in config.weight_shapes().items():
        if name.endswith(".encoder"):
            rows = config.key_layers if name.startswith("key") else config.value_layers
            used = len({s for r in rows for s in r})
            total += used * shape[1] * shape[2]
        elif name.endswith((".decoder", ".weight")):
            total += shape[0] * shape[-2] * shape[-1] * (shape[1] if len(shape) == 4 else 1)
    return total
