"""What every converter shares: errors, safe loading, checksums, assembling our translator.

A converter reads one PyTorch layout and returns a `Converted`: our `TranslatorConfig`, the
tensors in our orientation (`x @ W`, input = the listed source layers concatenated, each as
[head][dim]), and a `provenance` report. `write` turns it into our translator file and reads
the file back through the strict loader, so nothing unverified leaves a converter.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import pickle
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
from mlx_kvlingo.models.files import load_translator, model_key, save_translator

import mlx.core as mx
import numpy as np

# -- errors: one class per way an input can be wrong --------------------------------------


class ConversionError(ValueError):
    """An input that cannot be converted faithfully."""


class UnsafePickleError(ConversionError):
    """A PyTorch file whose pickle would run code (or needs classes) beyond plain tensors."""


class ChecksumError(ConversionError):
    """SHA256SUMS missing, incomplete, or not matching the files."""


class MissingTensorError(ConversionError):
    """A tensor the layout requires is absent."""


class UnexpectedTensorError(ConversionError):
    """A tensor the layout does not define (we do not guess what it means)."""


class ShapeMismatchError(ConversionError):
    """A tensor's shape contradicts the manifest, header, sidecar or command-line geometry."""


class UnknownSchemaError(ConversionError):
    """An unknown schema name or version, or an input whose layout cannot be recognised."""


class NonFiniteWeightError(ConversionError):
    """A weight holds NaN or Inf."""


class GeometryMismatchError(ConversionError):
    """The translator's geometry differs from the model pair named with --source/--target."""


class DirectionError(ConversionError):
    """The input names the model pair the other way round (its target is our source)."""


class UnsupportedError(ConversionError):
    """A well-formed input using a feature we refuse because it cannot be converted exactly."""


class InvalidInputError(ConversionError):
    """A malformed manifest, header or sidecar, or missing information."""


# -- reading inputs -----------------------------------------------------------------------


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def import_torch():
    try:
        import torch
    except ImportError:
        raise ConversionError(
            "this input is a PyTorch file and needs torch to read: pip install 'mlx-kvlingo[torch]'"
        ) from None
    return torch


def torch_load(path: str | Path):
    """`torch.load(weights_only=True)`: tensors and plain containers only, never code."""
    torch = import_torch()
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL (\S+)", str(e))
        what = f"it references `{m.group(1)}`" if m else "weights-only loading failed"
        raise UnsafePickleError(
            f"{path}: refused: this pickle needs objects beyond tensors and plain containers "
            f"({what}); nothing in it was executed. Re-save the checkpoint with only tensors "
            "and plain dicts/lists/numbers"
        ) from None
    except Exception as e:  # noqa: BLE001 - a corrupt pickle or zip fails in many ways
        raise InvalidInputError(
            f"{path}: not a readable PyTorch file ({type(e).__name__}: {str(e)[:200]})"
        ) from None


def is_safetensors(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file() or path.stat().st_size < 10:
        return False
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n <= path.stat().st_size - 8 and f.read(1) == b"{"


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of a .safetensors file as float32 numpy arrays, without torch."""
    try:
        tensors = mx.load(str(path))
    except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
        raise InvalidInputError(f"{path}: cannot read safetensors ({e})") from None
    return {k: np.array(v.astype(mx.float32)) for k, v in tensors.items()}


def to_numpy(t) -> np.ndarray:
    """A torch tensor (any float dtype) as a float32 numpy array."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float32)
    if not (hasattr(t, "detach") and t.is_floating_point()):
        raise InvalidInputError(f"expected a floating-point tensor, got {type(t).__name__}")
    return t.detach().cpu().float().numpy()


def check_finite(name: str, a: np.ndarray) -> np.ndarray:
    bad = ~np.isfinite(a)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise NonFiniteWeightError(
            f"tensor {name} holds {int(bad.sum())} NaN/Inf values (first at index {where}); "
            "refusing to convert a broken checkpoint"
        )
    return a


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InvalidInputError(f"{path}: missing {what}") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{path}: {what} is a directory") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidInputError(
            f"{path}: {what} is not valid JSON ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"{path}: {what} must be a JSON object")
    return data


def parse_rows(obj, n_target: int | None, what: str) -> list[list[int]]:
    """A layer map as a list of source-layer lists, one per target layer.

    Accepts a list of lists or a {"<t>": [...]} dict with keys 0..Lt-1.
    """
    if isinstance(obj, dict):
        by_layer = {}
        for k, v in obj.items():
            if isinstance(k, str) and k.isdecimal() and str(int(k)) == k:
                k = int(k)
            if not isinstance(k, int) or isinstance(k, bool) or k in by_layer:
                raise InvalidInputError(
                    f"{what}: target layer keys must be integers, got {k!r:.40}"
                )
            by_layer[k] = v
        keys = sorted(by_layer)
        if keys != list(range(len(keys))):
            raise InvalidInputError(
                f"{what}: target layers must be 0..{len(keys) - 1}, got {keys[:20]}"
            )
        obj = [by_layer[k] for k in keys]
    if not isinstance(obj, list) or not all(isinstance(r, list) for r in obj):
        raise InvalidInputError(f"{what}: expected a list of source-layer lists per target layer")
    rows = []
    for t, r in enumerate(obj):
        if not r:
            raise UnsupportedError(f"{what}: target layer {t} reads no source layer")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in r):
            raise InvalidInputError(
                f"{what}: target layer {t}: {r!r} is not a list of layer indices"
            )
        rows.append(list(r))
    if n_target is not None and len(rows) != n_target:
        raise ShapeMismatchError(f"{what}: {len(rows)} target layers listed, expected {n_target}")
    return rows


# -- assembling our format ----------------------------------------------------------------


@dataclass
class LayerMap:
    """One target layer's map for keys or values, in our orientation (`x @ weight + bias`).

    mixing: weight (len(rows) * Hs * D, Ht * D'), bias (Ht * D',)
    headwise: weight (H, len(rows) * D, D'), bias (H, D')
    """

    rows: list[int]
    weight: np.ndarray
    bias: np.ndarray | None
    weight_name: str
    bias_name: str | None = None
    transposed: bool = False  # stored as torch [out, in]: report shapes that way


@dataclass
class Converted:
    config: TranslatorConfig
    tensors: dict[str, np.ndarray]
    provenance: dict
    names: dict = field(default_factory=dict)  # model names/revisions the input declares

    def translator(self) -> Translator:
        tr = Translator(self.config)
        tr.key = {k.split(".", 1)[1]: mx.array(v) for k, v in self.tensors.items() if k[0] == "k"}
        tr.value = {k.split(".", 1)[1]: mx.array(v) for k, v in self.tensors.items() if k[0] == "v"}
        return tr


def assemble(
    variant: str,
    source: Side,
    target: Side,
    key_maps: list[LayerMap],
    value_maps: list[LayerMap],
    key_cut: str,
) -> tuple[TranslatorConfig, dict[str, np.ndarray], dict]:
    """Check every layer's shapes and stack them into our tensors.

    Rows of unequal length within one kind are padded to the longest with zero weight blocks
    (reading the row's last source layer again), which computes exactly the same map.
    Returns the config, the tensors and a report of any padding.
    """
    tensors, rows_of, report = {}, {}, {}
    bias = {}
    for kind, maps, in_dim, out_dim in (
        ("key", key_maps, source.head_dim, target.head_dim),
        ("value", value_maps, source.value_dim, target.value_dim),
    ):
        if len(maps) != target.layers:
            raise ShapeMismatchError(f"{len(maps)} {kind} maps for {target.layers} target layers")
        nu = max(len(m.rows) for m in maps)
        ws, bs, rows, padded = [], [], [], {}
        has_bias = {m.bias is not None for m in maps}
        if len(has_bias) > 1:
            missing = [m.bias_name or f"{m.weight_name} bias" for m in maps if m.bias is None]
            raise MissingTensorError(
                f"some {kind} maps have a bias and others do not: missing {missing}"
            )
        for t, m in enumerate(maps):
            bad = [s for s in m.rows if s >= source.layers]
            if bad:
                raise ShapeMismatchError(
                    f"{kind} map of target layer {t} reads source layer {bad[0]}, "
                    f"the source has {source.layers} layers"
                )
            k = len(m.rows)
            if variant == "mixing":
                want = (k * source.kv_heads * in_dim, target.kv_heads * out_dim)
                want_b = (target.kv_heads * out_dim,)
            else:
                want = (target.kv_heads, k * in_dim, out_dim)
                want_b = (target.kv_heads, out_dim)
            because = f"{k} source layer(s) {m.rows} and the geometry"
            flip = (lambda shape: tuple(shape)[::-1]) if m.transposed else tuple
            check_shape(m.weight_name, flip(m.weight.shape), flip(want), because)
            check_finite(m.weight_name, m.weight)
            if m.bias is not None:
                check_shape(m.bias_name, m.bias.shape, want_b, "the target geometry")
                check_finite(m.bias_name, m.bias)
            w = m.weight
            if k < nu:  # pad with zero blocks: reads row[-1] again, contributes nothing
                axis = 0 if variant == "mixing" else 1
                block = w.shape[axis] // k
                pad = [(0, 0)] * w.ndim
                pad[axis] = (0, (nu - k) * block)
                w = np.pad(w, pad)
                padded[t] = k
            ws.append(w)
            bs.append(m.bias)
            rows.append(tuple(m.rows) + (m.rows[-1],) * (nu - k))
        tensors[f"{kind}.weight"] = np.stack(ws).astype(np.float32)
        bias[kind] = None if bs[0] is None else np.stack(bs).astype(np.float32)
        rows_of[kind] = tuple(rows)
        if padded:
            report[kind] = {"padded_to_nu": nu, "original_nu": padded}
    use_bias = any(b is not None for b in bias.values())
    if use_bias:
        for kind, dim in (("key", target.head_dim), ("value", target.value_dim)):
            b = bias[kind]
            if b is None:  # the other kind has a bias: a zero bias here is the same map
                shape = (target.layers, target.kv_heads * dim)
                if variant == "headwise":
                    shape = (target.layers, target.kv_heads, dim)
                b = np.zeros(shape, np.float32)
            tensors[f"{kind}.bias"] = b
    try:
        config = TranslatorConfig(
            variant,
            source,
            target,
            rows_of["key"],
            rows_of["value"],
            key_cut=key_cut,
            bias=use_bias,
        )
    except ValueError as e:
        raise ShapeMismatchError(str(e)) from None
    return config, tensors, report


def check_shape(name: str, shape: tuple, want: tuple, because: str) -> None:
    if tuple(shape) != tuple(want):
        raise ShapeMismatchError(
            f"tensor {name} has shape {tuple(shape)}, but {because} imply {tuple(want)}"
        )


# -- model pair and output ----------------------------------------------------------------


def side(layers: int, kv_heads: int, head_dim: int) -> Side:
    """A Side from three positive integers (anything else: InvalidInputError, never rounded)."""
    values = (layers, kv_heads, head_dim)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
               for v in values):  # fmt: skip
        raise InvalidInputError(
            f"geometry must be positive integers (layers, kv_heads, head_dim), got "
            f"{[str(v)[:20] for v in values]}"
        )
    return Side(int(layers), int(kv_heads), int(head_dim), int(head_dim))


def parse_geometry(text: str | None, what: str) -> Side | None:
    """'LAYERS,KV_HEADS,HEAD_DIM' -> Side."""
    if text is None:
        return None
    try:
        parts = [int(x) for x in text.replace("x", ",").split(",")]
        if len(parts) != 3 or min(parts) < 1:
            raise ValueError
    except ValueError:
        raise InvalidInputError(
            f"{what}: expected LAYERS,KV_HEADS,HEAD_DIM (e.g. 28,8,128), got {text!r}"
        ) from None
    return side(*parts)


def pair_sides(pair) -> tuple[Side, Side]:
    return Side.of(pair.source.geometry), Side.of(pair.target.geometry)


def check_geometry(config: TranslatorConfig, pair) -> None:
    """Refuse a conversion whose geometry differs from the named model pair."""
    for label, want, model in (
        ("source", config.source, pair.source),
        ("target", config.target, pair.target),
    ):
        have = Side.of(model.geometry)
        if want != have:
            diffs = ", ".join(
                f"{k} {getattr(want, k)} vs {getattr(have, k)}"
                for k in ("layers", "kv_heads", "head_dim", "value_dim")
                if getattr(want, k) != getattr(have, k)
            )
            raise GeometryMismatchError(
                f"the checkpoint's {label} geometry does not match {model.name}: {diffs} "
                "(checkpoint vs model)"
            )


def reversed_names(declared: dict, given: dict) -> bool:
    """True when `declared` ({"source", "target"} names) is the `given` pair the other way round."""
    ds, dt = model_key(declared.get("source")), model_key(declared.get("target"))
    gs, gt = model_key(given.get("source")), model_key(given.get("target"))
    if None in (ds, dt, gs, gt) or gs == gt:
        return False
    return (ds, dt) == (gt, gs)


def check_direction(path, declared: dict, given: dict) -> None:
    """Refuse an input made for the given pair the other way round (even with equal geometry)."""
    if reversed_names(declared, given):
        raise DirectionError(
            f"{path}: this translator maps {declared['source']} -> {declared['target']}, "
            f"the pair given is {given['source']} -> {given['target']}: the other direction. "
            "Swap --source and --target, or use the translator trained for this direction"
        )


def agree(label: str, declared: Side | None, given: Side | None) -> Side | None:
    """Two statements of one side's geometry must agree; returns whichever is known."""
    if declared is not None and given is not None and declared != given:
        raise GeometryMismatchError(
            f"{label} geometry: the input declares {declared.as_dict()}, "
            f"the model/command line gives {given.as_dict()}"
        )
    return declared or given


def jsonable(value, depth: int = 0):
    """`value` as plain JSON for a translator's provenance: what the input recorded, with
    tensors and other objects described rather than stored (and deep nesting cut)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value[:10_000] if isinstance(value, str) else value
    if depth > 32:
        return "<nested too deep>"
    if isinstance(value, dict):
        return {str(k)[:200]: jsonable(v, depth + 1) for k, v in list(value.items())[:1000]}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value[:1000]]
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"<tensor {str(dtype).replace('torch.', '')} {list(shape)}>"
    return f"<{type(value).__name__}>"


def write(converted: Converted, output: str | Path, pair=None) -> Path:
    """Save as our translator file, then load it back through the strict loader."""
    output = Path(output)
    if pair is not None:
        check_geometry(converted.config, pair)
    extra = {"provenance": jsonable(converted.provenance)}
    if pair is None:  # no models at hand: keep the names the input declares
        for label in ("source", "target"):
            s = getattr(converted.config, label)
            name = converted.names.get(label)
            extra[label] = {"name": name if isinstance(name, str) else None, **s.as_dict()}
    output.parent.mkdir(parents=True, exist_ok=True)
    save_translator(converted.translator(), output, pair, **extra)
    load_translator(output, pair)
    return output
