"""Layout 1: a `torch.save` dict with `schema: "kv_lingo_translator_v1"`.

    {"schema": "kv_lingo_translator_v1",
     "source_model", "source_revision", "target_model", "target_revision",
     "source_geometry" / "target_geometry": {"layers", "kv_heads", "head_dim", "width"},
     "cut": "k:pre_k_norm,v:v_proj",
     "state_dict": {"key_weight": [Lt, Ht*Dt, Hs*Ds], "value_weight": [...]}}

Used as `F.linear(x, W[l])` on source layer l (equal depth, head-mixing, no bias); inputs
and outputs flatten (heads, head_dim) head-major. Keys are taken before k_norm (the target
applies its own k_norm, then RoPE), values at v_proj. A stage-2 checkpoint of the same
translator adds optimizer/scheduler state and counters: we take the weights and record
which keys were ignored.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    Converted,
    InvalidInputError,
    LayerMap,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownSchemaError,
    UnsupportedError,
    agree,
    assemble,
    check_finite,
    sha256_file,
    side,
    to_numpy,
    torch_load,
)

LAYOUT = "kv_lingo_translator_v1"
SCHEMA = "kv_lingo_translator_v1"
#: The cut string the reference writes; what each spelling of it means for our key cut.
CUT = "k:pre_k_norm,v:v_proj"
CUTS = {
    "k:pre_k_norm,v:v_proj": "pre_norm",
    "pre_k_norm": "pre_norm",
    "pre_norm": "pre_norm",
    "k_proj": "pre_norm",
    "k:post_k_norm,v:v_proj": "post_norm",
    "post_k_norm": "post_norm",
    "post_norm": "post_norm",
}
WEIGHTS = ("key_weight", "value_weight")
#: Top-level keys a stage-2 training checkpoint may add; ignored (and recorded as such).
TRAINING_STATE = (
    "optimizer", "optimizer_state", "optimizer_state_dict", "scheduler", "scheduler_state_dict",
    "lr_scheduler", "scaler", "step", "global_step", "epoch", "stage", "rng_state", "loss",
    "best_loss", "config", "args", "train_config", "metrics",
)  # fmt: skip
KNOWN = (
    "schema", "source_model", "source_revision", "target_model", "target_revision",
    "source_geometry", "target_geometry", "cut", "state_dict", "model_state_dict",
)  # fmt: skip


def looks_like(obj) -> bool:
    return isinstance(obj, dict) and "schema" in obj


def _geometry(d, label):
    try:
        return side(d["layers"], d["kv_heads"], d["head_dim"])
    except (KeyError, TypeError, ValueError):
        raise InvalidInputError(
            f"{label}: expected a dict with layers, kv_heads, head_dim (and width), got {d!r}"
        ) from None


def convert(path: str | Path, *, loaded=None, source=None, target=None, **_) -> Converted:
    """Convert a layout-1 file (or its stage-2 checkpoint). `loaded`: the already loaded dict.

    `source`/`target` (Sides, e.g. from the model pair) must agree with the file's geometry.
    """
    path = Path(path)
    digest = sha256_file(path)
    obj = torch_load(path) if loaded is None else loaded
    if not isinstance(obj, dict):
        raise UnknownSchemaError(
            f"{path}: expected a dict with a 'schema' key, got {type(obj).__name__}"
        )
    schema = obj.get("schema")
    if schema != SCHEMA:
        raise UnknownSchemaError(
            f"{path}: unknown schema {schema!r}; this converter reads {SCHEMA!r}"
        )
    cut = obj.get("cut")
    if cut not in CUTS:
        raise UnsupportedError(
            f"{path}: cut {cut!r} is not one we can convert exactly; known cuts: {sorted(CUTS)} "
            "(keys must be RoPE-free, values at v_proj)"
        )
    key_cut = CUTS[cut]
    src = _geometry(obj.get("source_geometry"), "source_geometry")
    tgt = _geometry(obj.get("target_geometry"), "target_geometry")
    src = agree("source", src, source)
    tgt = agree("target", tgt, target)
    if src.layers != tgt.layers:
        raise UnsupportedError(
            f"{path}: layout {LAYOUT} maps layer l to layer l and needs equal depth; "
            f"source has {src.layers} layers, target {tgt.layers}"
        )
    sd_key = "state_dict" if "state_dict" in obj else "model_state_dict"
    sd = obj.get(sd_key)
    if not isinstance(sd, dict):
        raise MissingTensorError(f"{path}: no 'state_dict' holding {WEIGHTS}")
    missing = [k for k in WEIGHTS if k not in sd]
    if missing:
        raise MissingTensorError(f"{path}: state_dict is missing {missing} (has {sorted(sd)[:8]})")
    extra = sorted(set(sd) - set(WEIGHTS))
    if extra:
        raise UnexpectedTensorError(
            f"{path}: state_dict has tensors this layout does not define: {extra} "
            "(layout 1 has no bias; refusing to drop them)"
        )
    maps = {}
    for name, kind in (("key_weight", "key"), ("value_weight", "value")):
        w = to_numpy(sd[name])
        expect = (tgt.layers, tgt.kv_heads * tgt.head_dim, src.kv_heads * src.head_dim)
        if w.shape != expect:
            raise ShapeMismatchError(
                f"{path}: state_dict.{name} has shape {tuple(w.shape)}, but the geometries "
                f"in the file imply [target_layers, Ht*Dt, Hs*Ds] = {list(expect)}"
            )
        check_finite(f"state_dict.{name}", w)
        maps[kind] = [
            LayerMap([t], w[t].T.copy(), None, f"state_dict.{name}[{t}]") for t in range(tgt.layers)
        ]
    config, tensors, _ = assemble("mixing", src, tgt, maps["key"], maps["value"], key_cut)
    ignored = sorted(k for k in obj if k not in KNOWN)
    unknown = [k for k in ignored if k not in TRAINING_STATE]
    names = {"source": obj.get("source_model"), "target": obj.get("target_model")}
    provenance = {
        "layout": LAYOUT,
        "key_cut": key_cut,
        "original_cut": cut,
        "input": path.name,
        "input_sha256": digest,
        "source_model": names["source"],
        "source_revision": obj.get("source_revision"),
        "target_model": names["target"],
        "target_revision": obj.get("target_revision"),
        "source_width": (obj["source_geometry"] or {}).get("width"),
        "target_width": (obj["target_geometry"] or {}).get("width"),
        "stage2_checkpoint": any(k in obj for k in TRAINING_STATE),
        "ignored_keys": ignored,
    }
    if unknown:
        provenance["ignored_unknown_keys"] = unknown
    return Converted(config, tensors, provenance, names)
