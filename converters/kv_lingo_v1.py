"""Layout 1: knlp's KV-Lingo reproduction, a translator artifact or its stage-2 checkpoint.

    y_l = F.linear(x_l, W[l])     x_l: source layer l's K (or V) of one token, [head][dim] flat
                                  W: [layers, Ht*Dt, Hs*Ds], equal depth, no bias

then the target's k_norm on the keys, then its RoPE (our `pre_norm` cut: keys are `k_proj`
outputs, before k_norm and RoPE; values are `v_proj` outputs). Both files are `torch.save`
dicts written by mcgrof/knlp, research/kv_translate/published/; fields as read here:

translator (kv_lingo_train.py `translator_artifact`):
    schema            "kv_lingo_translator_v1"
    direction         e.g. "4b-to-8b" (a key of the trainer's DIRECTIONS)
    source, target    {"name", "revision"}                          -> names, revisions
    source_geometry,  {"layers", "kv_heads", "head_dim", "width"}   (`geometry_dict`)
      target_geometry
    cut               "pre-k_norm keys and v_proj values; target k_norm then RoPE"  (CAPTURE_CUT)
    state_dict        {"key_weight", "value_weight"}: `LinearTranslator.state_dict()` (kv_lingo.py)
    method_identity, parameter_dtype, stage, provenance             -> recorded
stage-2 checkpoint (kv_lingo_train.py `checkpoint_state`):
    schema            "kv_lingo_stage2_checkpoint_v1"
    translator        {"key_weight", "value_weight"}  (the same state_dict, nested here)
    direction, source_geometry, target_geometry, global_step, sample_cursor, stage1_artifact,
    total_schedule_steps, warmup_steps, effective_batch, learning_rate -> recorded
    optimizer, rng, metrics, distributed                               -> ignored (training state)
    It has no `cut` (the trainer only continues stage-1 artifacts whose cut is CAPTURE_CUT, and
    its forward is the same) and no model names: those come from `direction` through the
    trainer's DIRECTIONS / PINS tables, or from the model pair named at conversion.

A `cut` we do not recognise is refused unless the caller states the key cut (`key_cut=`),
which is then recorded in the provenance as an override.
"""

from __future__ import annotations

from pathlib import Path

from mlx_kvlingo.kv.capture import KEY_CUTS

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
    check_direction,
    check_finite,
    sha256_file,
    side,
    to_numpy,
    torch_load,
)

LAYOUT = "kv_lingo_translator_v1"
SCHEMA = "kv_lingo_translator_v1"
CHECKPOINT_SCHEMA = "kv_lingo_stage2_checkpoint_v1"
SCHEMAS = (SCHEMA, CHECKPOINT_SCHEMA)
#: kv_lingo_train.py CAPTURE_CUT: the one cut string the writer stores, and our name for it.
CUTS = {"pre-k_norm keys and v_proj values; target k_norm then RoPE": "pre_norm"}
#: kv_lingo_train.py DIRECTIONS and PINS: the pair a `direction` names (stage-2 checkpoints
#: carry nothing else).
DIRECTIONS = {
    "4b-to-8b": (
        ("Qwen/Qwen3-4B", "1cfa9a7208912126459214e8b04321603b3df60c"),
        ("Qwen/Qwen3-8B", "b968826d9c46dd6066d109eabc6255188de91218"),
    ),
    "8b-to-4b": (
        ("Qwen/Qwen3-8B", "b968826d9c46dd6066d109eabc6255188de91218"),
        ("Qwen/Qwen3-4B", "1cfa9a7208912126459214e8b04321603b3df60c"),
    ),
}
WEIGHTS = ("key_weight", "value_weight")
#: where each schema keeps its weights
WEIGHTS_UNDER = {SCHEMA: "state_dict", CHECKPOINT_SCHEMA: "translator"}
#: top-level keys each schema's writer produces (anything else is recorded as unknown)
KNOWN = {
    SCHEMA: (
        "schema", "method_identity", "direction", "source", "target", "source_geometry",
        "target_geometry", "cut", "parameter_dtype", "stage", "state_dict", "provenance",
    ),
    CHECKPOINT_SCHEMA: (
        "schema", "direction", "global_step", "sample_cursor", "total_schedule_steps",
        "warmup_steps", "effective_batch", "learning_rate", "source_geometry", "target_geometry",
        "translator", "optimizer", "rng", "stage1_artifact", "metrics", "distributed",
    ),
}  # fmt: skip
TRAINING_STATE = ("optimizer", "rng", "metrics", "distributed")


def looks_like(obj) -> bool:
    return isinstance(obj, dict) and "schema" in obj


def _geometry(d, label):
    if not isinstance(d, dict) or not all(k in d for k in ("layers", "kv_heads", "head_dim")):
        raise InvalidInputError(
            f"{label}: expected a dict with layers, kv_heads, head_dim, width; got {d!r:.200}"
        )
    try:
        s = side(d["layers"], d["kv_heads"], d["head_dim"])
    except InvalidInputError as e:
        raise InvalidInputError(f"{label}: {e}") from None
    width = d.get("width")
    if width is not None and (not isinstance(width, int) or width != s.kv_heads * s.head_dim):
        raise InvalidInputError(f"{label}: width {str(width)[:40]} is not kv_heads * head_dim")
    return s


def _named(d, label) -> tuple[str | None, str | None]:
    if d is None:
        return None, None
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise InvalidInputError(f"{label}: expected {{'name': ..., 'revision': ...}}, got {d!r}")
    return d["name"], d.get("revision")


def convert(
    path: str | Path, *, loaded=None, source=None, target=None, key_cut: str | None = None,
    names: dict | None = None, **_,
) -> Converted:  # fmt: skip
    """Convert a knlp translator artifact or stage-2 checkpoint. `loaded`: the loaded dict.

    `source`/`target` (Sides, e.g. from the model pair) must agree with the file's geometry;
    `names` ({"source", "target"}: the pair's model names) must not be the file's pair
    reversed; `key_cut` overrides an unrecognised `cut` string.
    """
    path = Path(path)
    digest = sha256_file(path)
    obj = torch_load(path) if loaded is None else loaded
    if not isinstance(obj, dict):
        raise UnknownSchemaError(
            f"{path}: expected a dict with a 'schema' key, got {type(obj).__name__}"
        )
    schema = obj.get("schema")
    if not isinstance(schema, str) or schema not in SCHEMAS:
        raise UnknownSchemaError(
            f"{path}: unknown schema {schema!r}; this converter reads {SCHEMAS}"
        )
    if key_cut is not None and key_cut not in KEY_CUTS:
        raise InvalidInputError(f"key_cut must be one of {KEY_CUTS}, got {key_cut!r}")
    given, cut = key_cut, obj.get("cut")
    if schema == CHECKPOINT_SCHEMA:
        if cut is not None:
            raise UnexpectedTensorError(f"{path}: a {schema} has no 'cut'; this one does")
        implied = "pre_norm"  # kv_lingo_train.py resumes only from CAPTURE_CUT artifacts
        cut_note = "none stored; the stage-2 trainer's CAPTURE_CUT is implied"
    elif isinstance(cut, str) and cut in CUTS:
        implied, cut_note = CUTS[cut], cut
    elif key_cut is None:
        raise UnsupportedError(
            f"{path}: cut {cut!r} is not one we can convert; known: {sorted(CUTS)}. If you know "
            "where the keys were taken, say so with --key-cut pre_norm (k_proj output, before "
            "k_norm and RoPE) or --key-cut post_norm (after k_norm, before RoPE); values must be "
            "v_proj outputs"
        )
    else:
        implied, cut_note = None, cut
    key_cut = given or implied

    src = agree("source", _geometry(obj.get("source_geometry"), "source_geometry"), source)
    tgt = agree("target", _geometry(obj.get("target_geometry"), "target_geometry"), target)
    if src.layers != tgt.layers:
        raise UnsupportedError(
            f"{path}: layout {LAYOUT} maps layer l to layer l and needs equal depth; "
            f"source has {src.layers} layers, target {tgt.layers}"
        )
    direction = obj.get("direction")
    if direction is not None and not isinstance(direction, str):
        raise InvalidInputError(f"{path}: direction must be a string, got {direction!r:.80}")
    declared = DIRECTIONS.get(direction, ((None, None), (None, None)))
    if schema == SCHEMA:
        (s_name, s_rev), (t_name, t_rev) = (
            _named(obj.get("source"), "source"),
            _named(obj.get("target"), "target"),
        )
        if direction in DIRECTIONS and (s_name, t_name) == (declared[1][0], declared[0][0]):
            raise InvalidInputError(
                f"{path}: direction {direction!r} names {declared[0][0]} -> {declared[1][0]}, "
                f"but source/target say {s_name} -> {t_name}"
            )
    else:
        (s_name, s_rev), (t_name, t_rev) = declared
    if names:
        check_direction(path, {"source": s_name, "target": t_name}, names)

    key = WEIGHTS_UNDER[schema]
    sd = obj.get(key)
    if not isinstance(sd, dict):
        raise MissingTensorError(f"{path}: no {key!r} holding {WEIGHTS}")
    missing = [k for k in WEIGHTS if k not in sd]
    if missing:
        raise MissingTensorError(f"{path}: {key} is missing {missing} (has {sorted(sd)[:8]})")
    extra = sorted(set(sd) - set(WEIGHTS))
    if extra:
        raise UnexpectedTensorError(
            f"{path}: {key} has tensors this layout does not define: {extra} "
            "(LinearTranslator has no bias; refusing to drop them)"
        )
    maps = {}
    for name, kind in (("key_weight", "key"), ("value_weight", "value")):
        w = to_numpy(sd[name])
        expect = (tgt.layers, tgt.kv_heads * tgt.head_dim, src.kv_heads * src.head_dim)
        if w.shape != expect:
            raise ShapeMismatchError(
                f"{path}: {key}.{name} has shape {tuple(w.shape)}, but the geometries "
                f"in the file imply [target_layers, Ht*Dt, Hs*Ds] = {list(expect)}"
            )
        check_finite(f"{key}.{name}", w)
        maps[kind] = [
            LayerMap([t], w[t].T.copy(), None, f"{key}.{name}[{t}]") for t in range(tgt.layers)
        ]
    config, tensors, _ = assemble("mixing", src, tgt, maps["key"], maps["value"], key_cut)
    known = KNOWN[schema]
    provenance = {
        "layout": LAYOUT,
        "schema": schema,
        "key_cut": key_cut,
        "original_cut": cut_note,
        "key_cut_override": given is not None and given != implied,  # stated by the caller
        "input": path.name,
        "input_sha256": digest,
        "direction": direction,
        "source_model": s_name,
        "source_revision": s_rev,
        "target_model": t_name,
        "target_revision": t_rev,
        "stage2_checkpoint": schema == CHECKPOINT_SCHEMA,
        "ignored_keys": sorted(k for k in obj if k in TRAINING_STATE),
    }
    for k in ("method_identity", "parameter_dtype", "stage", "provenance", "global_step",
              "sample_cursor", "total_schedule_steps", "warmup_steps", "effective_batch",
              "learning_rate", "stage1_artifact"):  # fmt: skip
        if k in obj:
            provenance["knlp_provenance" if k == "provenance" else k] = obj[k]
    if schema == CHECKPOINT_SCHEMA and isinstance(obj.get("metrics"), list) and obj["metrics"]:
        last = obj["metrics"][-1]
        if isinstance(last, dict) and "mean_kl" in last:
            provenance["last_mean_kl"] = last["mean_kl"]
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        provenance["ignored_unknown_keys"] = unknown
    return Converted(config, tensors, provenance, {"source": s_name, "target": t_name})
