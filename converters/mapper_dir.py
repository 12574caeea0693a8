"""Layout 2: semantic-router's mapper directory, `manifest.json` + `weights.safetensors` + `SHA256SUMS`.

    y_t = concat(x_s for s in source_layers_per_target[t]) @ W_t + b_t     (each x_s [head][dim])

Written by vllm-project/semantic-router, src/training/kv_mapper/ (artifact.py `write_artifact`,
fit.py `write_fitted_artifact`, fit_run.py `fit_capture`; applied as in distill.py
`LinearMapper.forward`). Fields as read here:

manifest.json (`Manifest.to_dict`):
    schema_version           1
    compatibility            (`CompatibilitySpec`) source_model, source_revision, target_model,
                             target_revision -> names; variant "full_head" (or "per_head");
                             num_kv_heads, head_dim: one value for both models (the fit uses the
                             same geometry on both sides); head_order "contiguous"; precision,
                             source_tp, target_tp -> recorded
    rope_stripped_on_keys    true: keys after k_norm, before RoPE (our `post_norm` cut)
    source_layers_per_target {"k": {"<t>": [s, ...]}, "v": {...}}: the source layers each target
                             layer reads, in input order
    mapper_id, topk, ridge_alpha, centered_inputs, calibration, evaluation_report -> recorded
weights.safetensors: float32 `target.{t}.{k,v}.W` [nu*H*D, H*D] and `target.{t}.{k,v}.b` [H*D]
    (`tensor_keys_for_layers`); whatever the variant, distill.py applies every map as x @ W + b
    over all heads, so that is what we convert (our `mixing` variant).
SHA256SUMS (`_write_checksums`): `<sha256>  manifest.json`, `<sha256>  weights.safetensors`,
    verified before anything else is read.

The manifest does not give the source's total layer count: it comes from the named source
model or `--source-layers`. Reads without torch.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .common import (
    ChecksumError,
    Converted,
    GeometryMismatchError,
    InvalidInputError,
    LayerMap,
    MissingTensorError,
    UnexpectedTensorError,
    UnknownSchemaError,
    UnsupportedError,
    agree,
    assemble,
    check_direction,
    load_safetensors,
    parse_rows,
    read_json,
    sha256_file,
    side,
)

LAYOUT = "mapper_directory"
SCHEMA_VERSIONS = (1,)
VARIANTS = {"full_head": "mixing", "per_head": "headwise"}
REQUIRED_FILES = ("manifest.json", "weights.safetensors")
TENSOR = re.compile(r"^target\.(\d+)\.([kv])\.([Wb])$")


def looks_like(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in (*REQUIRED_FILES, "SHA256SUMS"))


def verify_checksums(folder: Path) -> dict[str, str]:
    """Check every file SHA256SUMS lists (it must list the manifest and the weights)."""
    sums_path = folder / "SHA256SUMS"
    if not sums_path.is_file():
        raise ChecksumError(f"{folder}: no SHA256SUMS file; refusing an unverifiable mapper")
    listed = {}
    try:
        text = sums_path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChecksumError(f"{sums_path}: not a text file ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = re.match(r"^([0-9a-fA-F]{64}) [ *](.+)$", line.strip())
        if not m:
            raise ChecksumError(f"{sums_path}:{n}: not a `sha256sum` line: {line!r}")
        listed[m.group(2).strip()] = m.group(1).lower()
    for f in REQUIRED_FILES:
        if f not in listed:
            raise ChecksumError(f"{sums_path}: does not list {f}")
    for name, want in listed.items():
        p = folder / name
        if not p.is_file():
            raise ChecksumError(f"{folder}: SHA256SUMS lists {name}, which is missing")
        have = sha256_file(p)
        if have != want:
            raise ChecksumError(
                f"{folder}: checksum mismatch for {name}: SHA256SUMS says {want[:16]}..., "
                f"the file hashes to {have[:16]}... (corrupt or modified)"
            )
    return listed


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InvalidInputError(f"manifest {where}{key}: expected a positive integer, got {v!r}")
    return v


def convert(
    path: str | Path, *, source=None, target=None, source_layers: int | None = None,
    names: dict | None = None, **_,
) -> Converted:  # fmt: skip
    """Convert a mapper directory. `source`/`target`: Sides from a model pair (optional);
    `names`: the pair's model names, checked against the manifest's direction."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidInputError(f"{folder}: a mapper is a directory (manifest.json, weights...)")
    listed = verify_checksums(folder)  # before anything else
    manifest = read_json(folder / "manifest.json", "manifest")
    version = manifest.get("schema_version")
    if version not in SCHEMA_VERSIONS:
        raise UnknownSchemaError(
            f"{folder}: unknown manifest schema_version {version!r}; this converter reads "
            f"{list(SCHEMA_VERSIONS)}"
        )
    compat = manifest.get("compatibility")
    if not isinstance(compat, dict):
        top = sorted(manifest)[:12]
        raise UnknownSchemaError(
            f"{folder}: the manifest has no 'compatibility' object (top level: {top}); "
            "semantic-router keeps variant, head counts, head dim and model names there"
        )
    variant = compat.get("variant")
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise UnknownSchemaError(
            f"{folder}: unknown compatibility.variant {variant!r:.80}; expected one of "
            f"{sorted(VARIANTS)}"
        )
    if manifest.get("rope_stripped_on_keys") is not True:
        raise UnsupportedError(
            f"{folder}: rope_stripped_on_keys is {manifest.get('rope_stripped_on_keys')!r}: a map "
            "fit on rotated keys depends on position and cannot be applied to RoPE-free keys"
        )
    head_order = compat.get("head_order", "contiguous")
    if head_order != "contiguous":
        raise UnsupportedError(
            f"{folder}: compatibility.head_order {head_order!r}: only 'contiguous' (heads in "
            "order within each layer's features, as the writer's fit produces) is defined"
        )
    per_target = manifest.get("source_layers_per_target")
    if not isinstance(per_target, dict) or set(per_target) != {"k", "v"}:
        raise InvalidInputError(
            f"{folder}: manifest source_layers_per_target must be {{'k': {{...}}, 'v': {{...}}}}"
        )
    k_rows = parse_rows(per_target["k"], None, "source_layers_per_target.k")
    v_rows = parse_rows(per_target["v"], len(k_rows), "source_layers_per_target.v")
    heads = _int(compat, "num_kv_heads", "compatibility.")
    dim = _int(compat, "head_dim", "compatibility.")
    ls = source_layers or (source.layers if source is not None else None)
    if source_layers is not None and source is not None and source.layers != source_layers:
        raise GeometryMismatchError(
            f"{folder}: --source-layers {source_layers}, the source model has {source.layers}"
        )
    if ls is None:
        raise InvalidInputError(
            f"{folder}: the manifest does not give the source's layer count; name the source "
            "model (--source/--target) or pass --source-layers"
        )
    src = agree("source", side(ls, heads, dim), source)
    tgt = agree("target", side(len(k_rows), heads, dim), target)
    declared = {"source": compat.get("source_model"), "target": compat.get("target_model")}
    if names:
        check_direction(folder, declared, names)

    weights = folder / "weights.safetensors"
    tensors = load_safetensors(weights)
    unexpected = []
    for name in tensors:
        m = TENSOR.match(name)
        if not m or int(m.group(1)) >= tgt.layers:
            unexpected.append(name)
    if unexpected:
        raise UnexpectedTensorError(
            f"{weights}: tensors the manifest does not define: {sorted(unexpected)[:8]}"
        )
    maps = {}
    for kind, rows in (("k", k_rows), ("v", v_rows)):
        missing = [
            f"target.{t}.{kind}.{p}"
            for t in range(tgt.layers)
            for p in ("W", "b")
            if f"target.{t}.{kind}.{p}" not in tensors
        ]
        if missing:
            raise MissingTensorError(f"{weights}: missing tensors {missing[:8]}")
        maps[kind] = [
            LayerMap(
                rows[t],
                tensors[f"target.{t}.{kind}.W"],
                tensors[f"target.{t}.{kind}.b"],
                f"target.{t}.{kind}.W",
                f"target.{t}.{kind}.b",
            )
            for t in range(tgt.layers)
        ]
    config, out, padding = assemble("mixing", src, tgt, maps["k"], maps["v"], "post_norm")
    sums = (folder / "SHA256SUMS").read_bytes()
    provenance = {
        "layout": LAYOUT,
        "key_cut": "post_norm",
        "original_cut": "keys after k_norm, before RoPE (rope_stripped_on_keys); values at v_proj",
        "input": folder.name,
        "input_sha256": hashlib.sha256(sums).hexdigest(),
        "input_sha256_of": "SHA256SUMS (which pins every file)",
        "files_sha256": listed,
        "schema_version": version,
        "mapper_id": manifest.get("mapper_id"),
        "variant": variant,
        "source_model": declared["source"],
        "source_revision": compat.get("source_revision"),
        "target_model": declared["target"],
        "target_revision": compat.get("target_revision"),
        "precision": compat.get("precision"),
        "source_tp": compat.get("source_tp"),
        "target_tp": compat.get("target_tp"),
        "head_order": head_order,
        "topk": manifest.get("topk"),
        "ridge_alpha": manifest.get("ridge_alpha"),
        "centered_inputs": manifest.get("centered_inputs"),
        "calibration": manifest.get("calibration"),
        "evaluation_report": manifest.get("evaluation_report"),
        "source_layers_per_target": {"k": k_rows, "v": v_rows},
    }
    if padding:
        provenance["padding"] = padding
    return Converted(config, out, provenance, declared)
