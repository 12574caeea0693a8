"""Other ways to hand a prefix's cache to another model, behind the translator's interface.

Every method is a `CacheMethod`: `translate(span, target)` returns the target's cache, per
layer `(keys, values)` of shape (B, H, T, D), exactly like `Translator.translate`, so the
evaluation harness (`scoring.student_logp`) and `kvcache.append_kv` take any of them.
Methods that need more of the source than its K/V list the source hidden states they read in
`needs_hidden`; `capture_span` records them during the source's prefill (like `capture.prefill`
records `k_proj`), and they arrive in `span.hidden`.

| method | module | what crosses the wire | applies to |
|---|---|---|---|
| KV-Lingo | `KVLingo` here | source K/V of the layers the map reads | any pair |
| raw | `raw` | the source's K/V | identical KV geometry |
| quantized | `quantized` | the inner method's input, b-bit groups | as its inner method |
| DroidSpeak | `droidspeak` | source K/V outside a block + one hidden state | same architecture |
| SCD (REUSE) | `scd` | a low-rank code per layer | any pair |

They are calibrated where they are compared (`compare.calibrate_all`); only KV-Lingo's
translators are files (`load_method` reads one as a method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import SpanKV, prefill
from mlx_kvlingo.kv.scoring import Prepared, mean_kl
from mlx_kvlingo.kv.scoring import prepare as prepare_scored
from mlx_kvlingo.kv.translator import Side, Translator, with_native_first_layers
from mlx_kvlingo.models.files import load_translator

import mlx.core as mx

WIRE_BYTES = 2  # unquantized tensors cross the wire as float16
HIDDEN_POINTS = ("residual",)  # a decoder layer's input


class NotApplicable(ValueError):
    """A method that cannot serve this pair; the message is the reason."""


@dataclass
class SourceSpan(SpanKV):
    """A SpanKV plus source hidden states: {(point, layer): (B, T, d) float32}."""

    hidden: dict = field(default_factory=dict)


@runtime_checkable
class CacheMethod(Protocol):
    name: str  # method family: "kvlingo", "raw", "quantized", "droidspeak", "scd"
    key_cut: str  # the key cut the span must carry
    needs_hidden: tuple  # ((point, source layer), ...) read from span.hidden

    def translate(self, span: SpanKV, target) -> tuple[list, list]: ...

    def label(self) -> str: ...  # the method and its settings, for tables

    def wire_bytes_per_token(self) -> float: ...

    def nbytes(self) -> int: ...  # what the method stores (translator size)


# -- capture with hidden states --------------------------------------------------------------


class _InputRecorder:
    """Stands in for a decoder layer during a prefill and keeps its inputs (residual stream)."""

    def __init__(self, inner):
        self.inner = inner
        self.outputs: list[mx.array] = []

    def __call__(self, x, *args, **kwargs):
        self.outputs.append(x)
        return self.inner(x, *args, **kwargs)

    def __getattr__(self, name):  # the layer's modules (self_attn, ...) stay reachable
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


@contextmanager
def recording(model, points: Sequence[tuple[str, int]]):
    """Record the residual stream entering each layer of `points` (("residual", layer), ...)
    of `model` (a LoadedModel) while the block runs."""
    recs: dict = {}
    layers = model.layers
    try:
        for point, i in sorted(set(points)):
            if point not in HIDDEN_POINTS:
                raise ValueError(f"unknown hidden point {point!r}; expected one of {HIDDEN_POINTS}")
            recs[point, i] = _InputRecorder(layers[i])
            layers[i] = recs[point, i]
        yield recs
    finally:
        for (_, i), rec in recs.items():
            layers[i] = rec.inner


def capture_span(model, tokens, cut: str = "post_norm", points=(), cache=None) -> SourceSpan:
    """Prefill `tokens` (on top of `cache`, or a fresh one) and return their K/V and hidden
    states at `points`, float32 (float64 stays float64)."""
    cache = cache if cache is not None else new_cache(model)
    with recording(model, points) as recs:
        span = prefill(model, list(tokens), cache, cut=cut)
    hidden = {}
    for p, rec in recs.items():
        h = mx.concatenate(rec.outputs, axis=1)
        hidden[p] = h if h.dtype == mx.float64 else h.astype(mx.float32)
    mx.eval(list(hidden.values()))
    return SourceSpan(span.keys, span.values, span.start, span.tokens, hidden=hidden)


def prepare(pair, ex, key_cut: str = "post_norm", points=()) -> Prepared:
    """`scoring.prepare` with the source's hidden states at `points` in the span."""
    return prepare_scored(
        pair, ex, key_cut, capture_span(pair.source, list(ex.prefix)[:-1], key_cut, points)
    )


# -- helpers shared by the methods -----------------------------------------------------------


def anchored(keys: list, values: list, span, target, native_first: bool) -> tuple[list, list]:
    """With `native_first`, position 0 gets the target's own K/V (`kv/translator.py`, the anchor token): the attention
    sink depends only on its token id, so every method can keep it native at no per-prompt cost
    (KV-Lingo translators do so by default); compare methods with the same setting."""
    if native_first and span.start == 0 and getattr(span, "tokens", None):
        return with_native_first_layers(target, span.tokens[0], keys, values)
    return keys, values


def as_float(x: mx.array) -> mx.array:
    """float32 for the arithmetic (float64 is kept: exactness tests run in float64)."""
    return x if x.dtype == mx.float64 else x.astype(mx.float32)


def rotate_layers(keys: mx.array, target, start: int) -> mx.array:
    """RoPE-free keys (L, B, H, T, D) -> rotated with the target's RoPE at their positions."""
    L, B, H, T, D = keys.shape
    return target.rope(keys.reshape(L * B, H, T, D), offset=start).reshape(L, B, H, T, D)


def same_geometry(pair) -> str | None:
    """None when source and target caches have identical layout, else the reason."""
    s, t = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    if s != t:
        return (
            f"KV geometry differs (layers x KV heads x head dim: {s.layers}x{s.kv_heads}x"
            f"{s.head_dim} vs {t.layers}x{t.kv_heads}x{t.head_dim})"
        )
    return None


def same_architecture(pair) -> str | None:
    """None when the target's layers can run on the source's hidden states, else the reason."""
    why = same_geometry(pair)
    if why:
        return why
    sc, tc = pair.source.config, pair.target.config
    for key in ("model_type", "hidden_size", "num_attention_heads"):
        if sc.get(key) != tc.get(key):
            return f"architecture differs ({key}: {sc.get(key)} vs {tc.get(key)})"
    return None


# -- KV-Lingo's linear translator as a method ------------------------------------------------


class KVLingo:
    """A `Translator` seen as a CacheMethod (file: the translator format, unchanged)."""

    name = "kvlingo"
    needs_hidden = ()

    def __init__(self, translator: Translator, label: str | None = None):
        self.translator = translator
        self._label = label

    @property
    def key_cut(self) -> str:
        return self.translator.config.key_cut

    def translate(self, span, target):
        return self.translator.translate(span, target)

    def label(self) -> str:
        c = self.translator.config
        return self._label or f"kvlingo {c.variant} nu={c.nu_k}"

    def source_layers_read(self) -> list[int]:
        c = self.translator.config
        return sorted({s for r in c.key_layers + c.value_layers for s in r})

    def wire_bytes_per_token(self) -> float:
        s = self.translator.config.source
        n = len(self.source_layers_read())
        return n * s.kv_heads * (s.head_dim + s.value_dim) * WIRE_BYTES

    def nbytes(self) -> int:
        return sum(
            v.nbytes for p in (self.translator.key, self.translator.value) for v in p.values()
        )


def load_method(path, pair, label: str | None = None) -> KVLingo:
    """A translator file, checked against `pair`, as a method (`models.files.load_translator`:
    a wrong file or pair raises its `TranslatorFileError`)."""
    return KVLingo(load_translator(path, pair), label)


def human_bytes(n: float) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


__all__ = [
    "CacheMethod", "KVLingo", "NotApplicable", "SourceSpan", "capture_span", "load_method",
    "mean_kl", "prepare", "same_architecture", "same_geometry",
]  # fmt: skip
