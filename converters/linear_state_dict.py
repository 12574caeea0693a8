"""Layout 3: a plain `state_dict` of per-target-layer `nn.Linear` maps.

    k_maps.{t}.weight [Ht*Dt, nu*Hs*Ds], k_maps.{t}.bias [Ht*Dt] (optional), same for v_maps

as saved by `torch.save(module.state_dict())` (or the same names in a .safetensors file,
which converts without torch). `nn.Linear` orientation: y = x @ weight.T + bias; the input
concatenates the listed source layers, each flattened [head][dim]. The file says nothing
about geometry, layer map or key cut, so they come from a JSON sidecar (`<file>.json` next
to it, or `--sidecar`) and/or the command line; where both give a value they must agree:

    {"source": {"layers": 28, "kv_heads": 8, "head_dim": 128}, "target": {...},
     "key_layers": [[0, 1], ...], "value_layers": [[0], ...]   (or "layer_map" for both),
     "key_cut": "post_norm" | "pre_norm", "source_model": ..., "target_model": ...}

The geometry may also come from the model pair named with --source/--target.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlx_kvlingo.kv.capture import KEY_CUTS

from .common import (
    Converted,
    InvalidInputError,
    LayerMap,
    MissingTensorError,
    UnexpectedTensorError,
    agree,
    assemble,
    is_safetensors,
    load_safetensors,
    parse_rows,
    read_json,
    sha256_file,
    side,
    to_numpy,
    torch_load,
)

LAYOUT = "linear_state_dict"
NAME = re.compile(r"^(.*?)([kv])_maps\.(\d+)\.(weight|bias)$")


def looks_like(obj) -> bool:
    return isinstance(obj, dict) and (
        any(isinstance(k, str) and NAME.match(k) for k in obj)
        or (isinstance(obj.get("state_dict"), dict) and looks_like(obj["state_dict"]))
    )


def find_sidecar(path: Path) -> Path | None:
    for p in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if p.is_file() and p != path:
            return p
    return None


def _side(d, label) -> object:
    if d is None:
        return None
    try:
        return side(d["layers"], d["kv_heads"], d["head_dim"])
    except (KeyError, TypeError, ValueError, IndexError):
        raise InvalidInputError(
            f"sidecar {label}: expected {{layers, kv_heads, head_dim}} positive integers, "
            f"got {d!r:.200}"
        ) from None


def _one(label, *values):
    """The single value given among several sources (None = not given); they must agree."""
    given = [v for v in values if v is not None]
    if any(v != given[0] for v in given[1:]):
        raise InvalidInputError(f"{label}: the sidecar and command line disagree: {given}")
    return given[0] if given else None


def _layer_rows(value, n, what):
    if value is None:
        return None
    if value == "identity":
        return [[t] for t in range(n)]
    return parse_rows(value, n, what)


def convert(
    path: str | Path,
    *,
    loaded=None,
    source=None,
    target=None,
    sidecar: str | Path | None = None,
    layer_map=None,
    key_layers=None,
    value_layers=None,
    key_cut: str | None = None,
    **_,
) -> Converted:
    """Convert a state_dict of k_maps/v_maps. Geometry/layer map/cut: sidecar or arguments."""
    path = Path(path)
    digest = sha256_file(path)
    side_path = Path(sidecar) if sidecar else find_sidecar(path)
    meta = read_json(side_path, "sidecar") if side_path else {}
    src = agree("source", _side(meta.get("source"), "source"), source)
    tgt = agree("target", _side(meta.get("target"), "target"), target)
    if src is None or tgt is None:
        raise InvalidInputError(
            f"{path}: a plain state_dict does not say its geometry: give --source/--target "
            "models, --source-geometry/--target-geometry, or a JSON sidecar"
        )
    cut = _one("key_cut", meta.get("key_cut"), key_cut)
    if cut not in KEY_CUTS:
        raise InvalidInputError(
            f"{path}: the key cut must be given (sidecar key_cut or --key-cut), one of {KEY_CUTS}; "
            f"got {cut!r}. The file does not record where its keys were taken"
        )
    n = tgt.layers
    both = _one(
        "layer_map",
        _layer_rows(meta.get("layer_map"), n, "layer_map"),
        _layer_rows(layer_map, n, "layer_map"),
    )
    k_rows = _one(
        "key_layers", _layer_rows(meta.get("key_layers"), n, "key_layers"),
        _layer_rows(key_layers, n, "key_layers"),
    ) or both  # fmt: skip
    v_rows = _one(
        "value_layers", _layer_rows(meta.get("value_layers"), n, "value_layers"),
        _layer_rows(value_layers, n, "value_layers"),
    ) or both  # fmt: skip
    if k_rows is None or v_rows is None:
        raise InvalidInputError(
            f"{path}: no layer map: give --layer-map (JSON list of source-layer lists per target "
            "layer, or 'identity'), --key-layers/--value-layers, or put them in the sidecar"
        )

    if is_safetensors(path):
        sd = load_safetensors(path)
    else:
        sd = torch_load(path) if loaded is None else loaded
        if isinstance(sd, dict) and not any(NAME.match(str(k)) for k in sd):
            sd = sd.get("state_dict", sd)  # a {"state_dict": ...} wrapper
        if not isinstance(sd, dict):
            raise InvalidInputError(f"{path}: expected a state_dict, got {type(sd).__name__}")
    prefixes, unexpected = set(), []
    named = {}
    for k in sd:
        m = NAME.match(k) if isinstance(k, str) else None
        if not m or int(m.group(3)) >= n:
            unexpected.append(k)
            continue
        prefixes.add(m.group(1))
        named[(m.group(2), int(m.group(3)), m.group(4))] = k
    if unexpected or len(prefixes) > 1:
        raise UnexpectedTensorError(
            f"{path}: entries that are not k_maps/v_maps of the {n} target layers: "
            f"{sorted(map(str, unexpected))[:8] or sorted(prefixes)}"
        )
    prefix = prefixes.pop() if prefixes else ""
    maps = {}
    for kind, rows in (("k", k_rows), ("v", v_rows)):
        missing = [
            f"{prefix}{kind}_maps.{t}.weight" for t in range(n) if (kind, t, "weight") not in named
        ]
        if missing:
            raise MissingTensorError(f"{path}: missing tensors {missing}")
        layer_maps = []
        for t in range(n):
            w_name = named[(kind, t, "weight")]
            b_name = named.get((kind, t, "bias"))
            w = to_numpy(sd[w_name])
            if w.ndim != 2:
                raise InvalidInputError(f"{path}: {w_name} is not a 2-D nn.Linear weight")
            b = to_numpy(sd[b_name]) if b_name else None
            layer_maps.append(
                LayerMap(rows[t], w.T.copy(), b, w_name, b_name or f"{kind}_maps.{t}.bias", True)
            )
        maps[kind] = layer_maps
    config, tensors, padding = assemble("mixing", src, tgt, maps["k"], maps["v"], cut)
    names = {"source": meta.get("source_model"), "target": meta.get("target_model")}
    provenance = {
        "layout": LAYOUT,
        "key_cut": cut,
        "original_cut": f"{cut} (from {'the sidecar' if meta.get('key_cut') else 'the command line'})",
        "input": path.name,
        "input_sha256": digest,
        "sidecar": side_path.name if side_path else None,
        "sidecar_sha256": sha256_file(side_path) if side_path else None,
        "source_model": names["source"],
        "target_model": names["target"],
        "key_layers": k_rows,
        "value_layers": v_rows,
    }
    if padding:
        provenance["padding"] = padding
    return Converted(config, tensors, provenance, names)
