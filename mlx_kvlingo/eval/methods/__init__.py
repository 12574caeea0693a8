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

Files: linear methods use the translator file format (`format.save_translator` with a `method`
metadata key); the others a safetensors file whose metadata key `kvlingo_method` holds JSON
(schema `mlx-kvlingo/method`). `load_method` reads both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.kv.anchor import with_native_first_layers
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import SpanKV, prefill
from mlx_kvlingo.kv.scoring import Prepared, mean_kl
from mlx_kvlingo.kv.scoring import prepare as prepare_scored
from mlx_kvlingo.kv.translator import Side, Translator
from mlx_kvlingo.models.files import (
    TranslatorFileError,
    load_translator,
    parse_json,
    read_header,
    save_translator,
)

import mlx.core as mx
import numpy as np

WIRE_BYTES = 2  # unquantized tensors cross the wire as float16
HIDDEN_POINTS = ("residual",)  # a decoder layer's input
SCHEMA = "mlx-kvlingo/method"
SCHEMA_VERSION = 1
META_KEY = "kvlingo_method"


class NotApplicable(ValueError):
    """A method that cannot serve this pair; the message is the reason."""


class MethodFileError(TranslatorFileError):
    """A method file that is unreadable, inconsistent, or made for another pair."""


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

    def save(self, path: str | Path, pair=None) -> Path: ...


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
    """With `native_first`, position 0 gets the target's own K/V (`anchor.py`): the attention
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


def side_meta(model) -> dict:
    g = model.geometry
    return {
        "name": model.name,
        "model_type": g.model_type,
        "hidden_size": model.config.get("hidden_size"),
        **Side.of(g).as_dict(),
    }


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

    def save(self, path, pair=None) -> Path:
        return save_translator(self.translator, path, pair, method="kvlingo")


# -- method files ----------------------------------------------------------------------------


def write_method_file(path, tensors: dict, meta: dict) -> Path:
    """Atomically write tensors + `{"schema", "schema_version", **meta}` JSON metadata."""
    path = Path(path)
    meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **meta}
    with atomic_write(path) as tmp:
        mx.save_safetensors(str(tmp), tensors, metadata={META_KEY: json.dumps(meta)})
    return path


def read_method_file(path) -> tuple[dict, dict]:
    path = Path(path)
    header = read_header(path, MethodFileError, "method")
    raw = (header.get("__metadata__") or {}).get(META_KEY)
    if raw is None:
        raise MethodFileError(f"{path}: no {META_KEY} metadata: not a method file")
    meta = parse_json(raw, f"{path}: the {META_KEY} metadata", MethodFileError)
    if meta.get("schema") != SCHEMA or meta.get("schema_version") != SCHEMA_VERSION:
        raise MethodFileError(
            f"{path}: unsupported method schema {meta.get('schema')!r:.80} "
            f"version {meta.get('schema_version')!r:.40}"
        )
    try:
        tensors = mx.load(str(path))
    except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
        raise MethodFileError(f"{path}: cannot read tensors: {e}") from None
    for name, t in tensors.items():
        if not np.isfinite(np.array(t.astype(mx.float32))).all():
            raise MethodFileError(f"{path}: tensor {name} contains NaN or Inf")
    return tensors, meta


def check_method_pair(meta: dict, pair, path) -> None:
    for label in ("source", "target"):
        want = meta.get(label)
        model = getattr(pair, label)
        have = side_meta(model)
        if want is None:
            continue
        if not isinstance(want, dict):
            raise MethodFileError(f"{path}: metadata {label} must be an object")
        for k in ("layers", "kv_heads", "head_dim", "value_dim", "model_type", "hidden_size"):
            if want.get(k) is not None and want[k] != have[k]:
                raise MethodFileError(
                    f"{path}: made for a {label} with {k}={want[k]}, {model.name} has "
                    f"{have[k]}: wrong model pair"
                )


def load_method(path, pair=None):
    """Load any method file (translator format or method format) as a CacheMethod."""
    from mlx_kvlingo.eval.methods import droidspeak, quantized, raw, scd

    path = Path(path)
    header = read_header(path, MethodFileError, "method")
    meta = header.get("__metadata__") or {}
    if "kvlingo" in meta:
        tr = load_translator(path, pair)
        m = KVLingo(tr)
        wire = tr.config.metadata.get("wire")
        if tr.config.metadata.get("method") == "quantized" and wire:
            try:
                m = quantized.Quantized(m, wire["bits"], wire["group_size"])
            except _STATE_ERRORS as e:
                raise MethodFileError(f"{path}: invalid wire settings {wire!r:.80} ({e})") from None
        return m
    tensors, meta = read_method_file(path)
    if pair is not None:
        check_method_pair(meta, pair, path)
    kinds = {
        "raw": raw.RawTransfer,
        "quantized": quantized.Quantized,
        "droidspeak": droidspeak.DroidSpeak,
        "scd": scd.SCD,
    }
    method = meta.get("method")
    if not isinstance(method, str) or method not in kinds:
        raise MethodFileError(f"{path}: unknown method {method!r:.80}")
    try:
        m = kinds[method].from_state(tensors, meta)
    except _STATE_ERRORS as e:
        raise MethodFileError(f"{path}: inconsistent method file: {str(e)[:300]}") from None
    if pair is not None:
        _check_sides(m, pair, path)
    return m


def _check_sides(m, pair, path) -> None:
    """The geometry a loaded method says it was built for (`side`, or `source`/`target`,
    through a quantized method's `inner`) must be the pair's."""
    src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    wants = [("side", src), ("side", tgt), ("source", src), ("target", tgt)]
    while m is not None:
        for attr, have in wants:
            want = getattr(m, attr, None)
            if isinstance(want, Side) and want != have:
                raise MethodFileError(
                    f"{path}: made for {attr} geometry {want.as_dict()}, the pair has "
                    f"{have.as_dict()}: wrong model pair"
                )
        m = getattr(m, "inner", None)


#: what building a method from a file's (untrusted) metadata raises when a field is missing or
#: of the wrong type: all of it means "inconsistent method file"
_STATE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
                 ZeroDivisionError, RecursionError)  # fmt: skip


def human_bytes(n: float) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


__all__ = [
    "CacheMethod", "KVLingo", "MethodFileError", "NotApplicable", "SourceSpan",
    "capture_span", "load_method", "mean_kl", "prepare", "same_architecture", "same_geometry",
]  # fmt: skip
