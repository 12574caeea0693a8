"""One translator file: a `.safetensors` file with the tensors and JSON metadata.

Metadata key `kvlingo` holds a JSON object:
    schema, schema_version, variant, key_cut, bias, key_layers, value_layers,
    source / target: {name, model_type, layers, kv_heads, head_dim, value_dim, rope, has_k_norm},
    tokenizer (vocab fingerprint), dtype, quantization ({group_size, bits}: 8-bit files only), and
    free-form `calibration` / `provenance` reports.
A quantized file stores each map `X` (all but the biases) as mx.quantize's packed `X` with
`X_scales` and `X_biases` (groups along the last axis); loading dequantizes it.
Loading checks the file itself (truncation, schema, tensors, shapes, NaN/Inf) and then, when a
pair is given, that the file was made for that pair.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig

import mlx.core as mx
import numpy as np

SCHEMA = "mlx-kvlingo/translator"
SCHEMA_VERSION = 1


class TranslatorFileError(ValueError):
    """A translator file that is unreadable, inconsistent, or made for another pair."""


def _side_meta(model, side: Side) -> dict:
    meta = {"name": None, **side.as_dict()}
    if model is not None:
        g = model.geometry
        meta.update(name=model.name, model_type=g.model_type, rope=g.rope.as_dict(),
                    has_k_norm=g.has_k_norm)  # fmt: skip
    return meta


def translator_tensors(translator: Translator) -> dict:
    """The file's tensors: `key.<name>` and `value.<name>` for each of the two maps' arrays."""
    return {f"{s}.{k}": v for s in ("key", "value") for k, v in getattr(translator, s).items()}


def quantize(tensors: dict, bits: int = 8) -> tuple[dict, dict]:
    """Each map (every tensor but a bias) -> mx.quantize's packed `X` with `X_scales` and
    `X_biases`, groups of 64 along the last axis (32 where a map's width does not divide by 64);
    biases as they are. Returns the tensors and the metadata {group_size, bits}."""
    maps = [k for k in tensors if not k.endswith(".bias")]
    group = next((g for g in (64, 32) if all(tensors[k].shape[-1] % g == 0 for k in maps)), None)
    if group is None:
        raise ValueError(f"cannot quantize maps {maps} in groups of 64 or 32")
    out = dict(tensors)
    for name in maps:
        w, scales, biases = mx.quantize(tensors[name], group_size=group, bits=bits)
        out.update({name: w, f"{name}_scales": scales, f"{name}_biases": biases})
    return out, {"group_size": group, "bits": bits}


def dequantize(tensors: dict, q: dict) -> dict:
    """The inverse of `quantize` with metadata `q` = {group_size, bits}: each packed `X` ->
    mx.dequantize(X, X_scales, X_biases), in the scales' dtype."""
    out = {k: v for k, v in tensors.items() if not k.endswith(("_scales", "_biases"))}
    for name in [k for k in out if not k.endswith(".bias")]:
        parts = (tensors[name], tensors.get(f"{name}_scales"), tensors.get(f"{name}_biases"))
        if parts[1] is None or parts[2] is None or parts[0].dtype != mx.uint32:
            raise ValueError(f"{name} is not a packed map with its _scales and _biases")
        out[name] = mx.dequantize(*parts, group_size=q["group_size"], bits=q["bits"])
    return out


def save_translator(translator: Translator, path: str | Path, pair=None, dtype=None, bits=None,
                    **extra) -> Path:  # fmt: skip
    """Write the translator (atomically) with metadata describing `pair` and any `extra` keys;
    tensors in `dtype` (e.g. mx.float16), the maps quantized to `bits` (e.g. 8) if given."""
    c = translator.config
    tensors = translator_tensors(translator)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "variant": c.variant,
            "key_cut": c.key_cut, "bias": c.bias, "native_first": c.native_first,
            "key_layers": [list(r) for r in c.key_layers],
            "value_layers": [list(r) for r in c.value_layers],
            "source": _side_meta(pair.source if pair else None, c.source),
            "target": _side_meta(pair.target if pair else None, c.target),
            "tokenizer": pair.tokenizer_fingerprint if pair else None,
            "dtype": None, **c.metadata, **extra}  # fmt: skip
    meta["dtype"] = str(next(iter(tensors.values())).dtype).replace("mlx.core.", "")
    if bits:
        tensors, meta["quantization"] = quantize(tensors, bits)
    with atomic_write(path) as tmp:
        mx.save_safetensors(str(tmp), tensors, metadata={"kvlingo": json.dumps(meta)})
    return Path(path)


def parse_json(text, what: str, error=TranslatorFileError) -> dict:
    """JSON text (str or bytes) that must hold an object; anything else raises `error`."""
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as e:
        raise error(f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a JSON dict, not {type(value).__name__}")
    return value


def read_header(path: str | Path, error=TranslatorFileError, what: str = "translator") -> dict:
    """Check a safetensors file without loading its tensors (the `safetensors` library's checks:
    header, dtypes, shapes and offsets, the file's length); its metadata.
    `what` the file should be, for the messages; `error` the class to raise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: no such {what} file")
    try:
        with safe_open(str(path), "numpy") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        why = str(e).removeprefix("Error while deserializing header: ")
    with open(path, "rb") as f:
        head = f.read(4)
    convert = f"; convert it first: kvlingo convert {path} -o translator.safetensors"
    convert = convert if what == "translator" else ""
    if head == b"PK\x03\x04":  # torch.save writes a zip archive
        kind = "a PyTorch file (a torch.save zip archive)"
    elif head[:1] == b"\x80":
        kind = "a Python pickle (a legacy PyTorch file?)"
    else:
        raise error(f"{path}: truncated or not a safetensors file ({why[:200]})")
    raise error(f"{path}: this is {kind}, not a {what}{convert}")


def read_metadata(path: str | Path) -> dict:
    raw = read_header(path).get("kvlingo")
    if raw is None:
        raise TranslatorFileError(f"{path}: no kvlingo metadata: not a translator file")
    meta = parse_json(raw, f"{path}: the kvlingo metadata")
    if meta.get("schema") != SCHEMA:
        raise TranslatorFileError(f"{path}: unknown schema {meta.get('schema')!r:.80}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise TranslatorFileError(
            f"{path}: unsupported schema_version {meta.get('schema_version')!r:.40} "
            f"(this version of mlx-kvlingo reads {SCHEMA_VERSION})"
        )
    return meta


def config_from_metadata(meta: dict) -> TranslatorConfig:
    """The TranslatorConfig a file's metadata describes (ValueError, TypeError or KeyError
    naming the first field that is missing or of the wrong type)."""

    def side(label):
        d = meta[label]
        if not isinstance(d, dict):
            raise TypeError(f"{label} must be an object")
        return Side(d["layers"], d["kv_heads"], d["head_dim"], d.get("value_dim", d["head_dim"]))

    def rows(label):
        r = meta[label]
        if not isinstance(r, list) or not all(isinstance(x, list) for x in r):
            raise TypeError(f"{label} must be a list of lists of source layers")
        if not all(isinstance(s, int) and not isinstance(s, bool) for x in r for s in x):
            raise TypeError(f"{label} must list integer source layers")
        return tuple(tuple(x) for x in r)

    for label in ("variant", "key_cut"):
        if not isinstance(meta.get(label), str):
            raise TypeError(f"{label} must be a string")
    for label in ("bias", "native_first"):
        if not isinstance(meta.get(label, False), bool):
            raise TypeError(f"{label} must be true or false")
    skip = {
        "schema", "schema_version", "variant", "key_cut", "bias", "key_layers",
        "value_layers", "source", "target", "native_first",
    }  # fmt: skip
    return TranslatorConfig(meta["variant"], side("source"), side("target"), rows("key_layers"),
                            rows("value_layers"), meta["key_cut"], meta["bias"],
                            native_first=meta.get("native_first", False),
                            metadata={k: v for k, v in meta.items() if k not in skip})  # fmt: skip


def check_file(path: str | Path, source=None, target=None) -> tuple[dict, TranslatorConfig]:
    """(metadata, config) of a translator file, checked from its header alone (no tensors, no
    pair): a safetensors file, our schema and version, a consistent config and, given the
    `source` and `target` models' names, not made for them the other way round."""
    meta = read_metadata(path)
    try:
        config = config_from_metadata(meta)
    except KeyError as e:
        raise TranslatorFileError(f"{path}: inconsistent metadata: missing {e}") from None
    except (TypeError, ValueError) as e:
        raise TranslatorFileError(f"{path}: inconsistent metadata: {str(e)[:300]}") from None
    check_direction(meta, path, source, target)
    return meta, config


def load_translator(path: str | Path, pair=None, dtype="auto") -> Translator:
    """Load and validate a translator file (with `pair`: made for it), in `dtype` ("auto": the
    backend's, `models.pair.default_dtype`)."""
    path = Path(path)
    meta, config = check_file(path)
    if pair is not None:
        check_pair(meta, config, pair, path)
    try:
        tensors = mx.load(str(path))
    except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
        raise TranslatorFileError(f"{path}: cannot read tensors: {e}") from None
    if meta.get("quantization"):
        try:
            tensors = dequantize(tensors, meta["quantization"])
        except (KeyError, TypeError, ValueError) as e:
            raise TranslatorFileError(f"{path}: bad quantized tensors: {str(e)[:300]}") from None
    expected = config.weight_shapes()
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        what, names = ("missing", missing) if missing else ("unexpected", unexpected)
        raise TranslatorFileError(f"{path}: {what} tensors {sorted(names)}")
    for name, shape in expected.items():
        if not mx.issubdtype(tensors[name].dtype, mx.floating):
            raise TranslatorFileError(
                f"{path}: tensor {name} is {tensors[name].dtype}, a translator's are floating point"
            )
        if tuple(tensors[name].shape) != shape:
            raise TranslatorFileError(
                f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"the metadata implies {shape}"
            )
        if not np.isfinite(np.array(tensors[name].astype(mx.float32))).all():
            raise TranslatorFileError(f"{path}: tensor {name} contains NaN or Inf")
    from mlx_kvlingo.models.pair import default_dtype

    dtype = default_dtype(dtype)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    tr = Translator(config, dtype=next(iter(tensors.values())).dtype)
    tr.key = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("key.")}
    tr.value = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("value.")}
    # evaluate now: a lazy cast would carry this thread's stream into the thread that
    # translates (a server's worker), where MLX refuses it ("no Stream(cpu, 0) in thread")
    mx.eval(tr.parameters())
    tr.path = path  # where it came from (a demo's shipped file carries its measured retention)
    return tr


def model_key(name) -> str | None:
    """A model's name for comparison, its last path component in lower case: `Qwen/Qwen3-4B`,
    `~/models/Qwen3-4B/` and `Qwen3-4B` compare equal; None stays None."""
    if not name or not isinstance(name, (str, Path)):
        return None
    return str(name).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower() or None


def check_direction(meta: dict, path, source, target, swapped: bool = False) -> None:
    """Refuse a file made for the models named `source` -> `target` the other way round: by the
    names it declares, or (`swapped`, the pair's geometry) its sides' shapes."""
    names = model_key(source), model_key(target)
    # the names the file gives each side: its own and, converted, the original file's
    prov = meta.get("provenance") if isinstance(meta.get("provenance"), dict) else {}
    made = [
        {model_key(meta[s].get("name")), model_key(prov.get(f"{s}_model"))} - {None}
        for s in ("source", "target")
    ]
    by_name = all(names) and names[0] != names[1] and names[0] in made[1] and names[1] in made[0]
    if (by_name and names[0] not in made[0]) or swapped:
        raise TranslatorFileError(
            f"{path}: this translator goes the other way ({meta['source'].get('name')} -> "
            f"{meta['target'].get('name')}), the pair is {source} -> {target}; swap source "
            "and target or use the reverse file"
        )


def check_pair(meta: dict, config: TranslatorConfig, pair, path) -> None:
    """Refuse a file made for another pair, or for this pair the other way round (by the names
    it declares, or by its geometry)."""
    src, tgt = Side.of(pair.source.geometry), Side.of(pair.target.geometry)
    swapped = (config.source, config.target) == (tgt, src) and src != tgt
    check_direction(meta, path, pair.source.name, pair.target.name, swapped)
    for label, want, have, model in (("source", config.source, src, pair.source),
                                     ("target", config.target, tgt, pair.target)):  # fmt: skip
        if want != have:
            raise TranslatorFileError(
                f"{path}: made for a {label} with {want.layers} layers, {want.kv_heads} KV heads, "
                f"head dim {want.head_dim}; {model.name} has {have.layers} layers, "
                f"{have.kv_heads} KV heads, head dim {have.head_dim}: wrong model pair"
            )
        mt = meta[label].get("model_type")
        # an exact upcycle (models/demo/moe.py) keeps the K/V cache of the model it came from
        kv_of = (getattr(model, "config", None) or {}).get("kvlingo_upcycle", {}).get("model_type")
        if mt and mt not in (model.geometry.model_type, kv_of):
            raise TranslatorFileError(
                f"{path}: made for a {mt} {label}, {model.name} is {model.geometry.model_type}"
            )
        if meta[label].get("has_k_norm") not in (None, model.geometry.has_k_norm):
            raise TranslatorFileError(f"{path}: {label} k_norm presence differs from {model.name}")
    fp = meta.get("tokenizer")
    if fp and pair.tokenizer_fingerprint and fp != pair.tokenizer_fingerprint:
        raise TranslatorFileError(
            f"{path}: made for a different tokenizer (fingerprint {fp}, pair has "
            f"{pair.tokenizer_fingerprint})"
        )
