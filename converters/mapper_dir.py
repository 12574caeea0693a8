"""Layout 2: a mapper directory, `manifest.json` + `weights.safetensors` + `SHA256SUMS`.

    manifest.json: {"schema_version": 1, "variant": "full_head" | "per_head",
                    "source_model", "source_revision", "target_model", "target_revision",
                    "num_kv_heads": H or {"source": Hs, "target": Ht},
                    "head_dim": D or {"source": Ds, "target": Dt},
                    "ridge_alpha", "centered_inputs", "rope_stripped_on_keys": true,
                    "source_layers_per_target": {"k": {"<t>": [s, ...]}, "v": {...}}}
    weights.safetensors: target.{t}.{k,v}.W  (+ optional .b), applied as x @ W + b
        full_head: W [nu*Hs*Ds, Ht*Dt], b [Ht*Dt]     (input: listed layers, each [head][dim])
        per_head:  W [H, nu*Ds, Dt],    b [H, Dt]     (head h reads head h of listed layers)

Keys after k_norm, before RoPE (our `post_norm` cut). Checksums are verified before anything
else is read. The number of source layers is not in the manifest: it comes from the named
source model, an optional manifest `num_layers`, or `--source-layers`. Reads without torch.
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
    for n, line in enumerate(sums_path.read_text().splitlines(), 1):
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


def _per_side(manifest: dict, key: str, required: bool = True):
    v = manifest.get(key)
    if v is None and not required:
        return None, None
    if isinstance(v, int) and not isinstance(v, bool):
        return v, v
    if (
        isinstance(v, dict)
        and isinstance(v.get("source"), int)
        and isinstance(v.get("target"), int)
    ):
        return v["source"], v["target"]
    raise InvalidInputError(
        f"manifest {key}: expected an int or {{'source': int, 'target': int}}, got {v!r}"
    )


def convert(
    path: str | Path, *, source=None, target=None, source_layers: int | None = None, **_
) -> Converted:
    """Convert a mapper directory. `source`/`target`: Sides from a model pair (optional)."""
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
    variant = VARIANTS.get(manifest.get("variant"))
    if variant is None:
        raise UnknownSchemaError(
            f"{folder}: unknown variant {manifest.get('variant')!r}; expected one of {sorted(VARIANTS)}"
        )
    if manifest.get("rope_stripped_on_keys") is not True:
        raise UnsupportedError(
            f"{folder}: rope_stripped_on_keys is {manifest.get('rope_stripped_on_keys')!r}: a map "
            "fit on rotated keys depends on position and cannot be applied to RoPE-free keys"
        )
    per_target = manifest.get("source_layers_per_target")
    if not isinstance(per_target, dict) or set(per_target) != {"k", "v"}:
        raise InvalidInputError(
            f"{folder}: manifest source_layers_per_target must be {{'k': {{...}}, 'v': {{...}}}}"
        )
    k_rows = parse_rows(per_target["k"], None, "source_layers_per_target.k")
    v_rows = parse_rows(per_target["v"], len(k_rows), "source_layers_per_target.v")
    hs, ht = _per_side(manifest, "num_kv_heads")
    ds, dt = _per_side(manifest, "head_dim")
    ls, lt = _per_side(manifest, "num_layers", required=False)
    if lt is not None and lt != len(k_rows):
        raise InvalidInputError(
            f"{folder}: manifest num_layers says {lt} target layers, "
            f"source_layers_per_target lists {len(k_rows)}"
        )
    if ls is not None and source_layers is not None and ls != source_layers:
        raise GeometryMismatchError(
            f"{folder}: manifest num_layers gives {ls} source layers, --source-layers {source_layers}"
        )
    ls = ls or source_layers or (source.layers if source is not None else None)
    if ls is None:
        raise InvalidInputError(
            f"{folder}: the manifest does not give the source's layer count; name the source "
            "model (--source/--target) or pass --source-layers"
        )
    src = agree("source", side(ls, hs, ds), source)
    tgt = agree("target", side(len(k_rows), ht, dt), target)
    if variant == "headwise" and hs != ht:
        raise UnsupportedError(f"{folder}: per_head needs equal KV head counts ({hs} vs {ht})")

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
            f"target.{t}.{kind}.W"
            for t in range(tgt.layers)
            if f"target.{t}.{kind}.W" not in tensors
        ]
        if missing:
            raise MissingTensorError(f"{weights}: missing tensors {missing}")
        maps[kind] = [
            LayerMap(
                rows[t],
                tensors[f"target.{t}.{kind}.W"],
                tensors.get(f"target.{t}.{kind}.b"),
                f"target.{t}.{kind}.W",
                f"target.{t}.{kind}.b",
            )
            for t in range(tgt.layers)
        ]
    config, out, padding = assemble(variant, src, tgt, maps["k"], maps["v"], "post_norm")
    names = {"source": manifest.get("source_model"), "target": manifest.get("target_model")}
    sums = (folder / "SHA256SUMS").read_bytes()
    provenance = {
        "layout": LAYOUT,
        "key_cut": "post_norm",
        "original_cut": "keys after k_norm, before RoPE (rope_stripped_on_keys); values at v_proj",
        "input": folder.name,
        "input_sha256": hashlib.sha256(sums).hexdigest(),
        "input_sha256_of": "SHA256SUMS (which pins every file)",
        "files_sha256": listed,
        "variant": manifest["variant"],
        "schema_version": version,
        "source_model": names["source"],
        "source_revision": manifest.get("source_revision"),
        "target_model": names["target"],
        "target_revision": manifest.get("target_revision"),
        "ridge_alpha": manifest.get("ridge_alpha"),
        "centered_inputs": manifest.get("centered_inputs"),
        "source_layers_per_target": {"k": k_rows, "v": v_rows},
    }
    if padding:
        provenance["padding"] = padding
    return Converted(config, out, provenance, names)
