"""Converters from translators trained in PyTorch to our MLX translator file.

Importable from a checkout as `converters` (`python -m converters ...`) and, once the package
is installed, as `kvlingo_converters` (behind `kvlingo convert`). Three layouts:

    kv_lingo_translator_v1   knlp's translator artifact and stage-2 checkpoint   kv_lingo_v1.py
                             (mcgrof/knlp, research/kv_translate/published/kv_lingo_train.py)
    mapper_directory         semantic-router's mapper directory: manifest.json   mapper_dir.py
                             + weights.safetensors + SHA256SUMS
                             (vllm-project/semantic-router, src/training/kv_mapper/artifact.py)
    linear_state_dict        a plain torch `state_dict()` of k_maps/v_maps       linear_state_dict.py
                             nn.Linear; no public writer fixes its metadata, so
                             geometry, layer map and cut are stated by the user

`torch_reference.py` is the PyTorch reference translator used by the parity tests. torch is
imported only to read PyTorch files (and by the reference), never for the mapper directory.
"""

from __future__ import annotations

from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)

from . import kv_lingo_v1, linear_state_dict, mapper_dir
from .common import (
    ChecksumError,
    ConversionError,
    Converted,
    DirectionError,
    GeometryMismatchError,
    InvalidInputError,
    MissingTensorError,
    NonFiniteWeightError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownSchemaError,
    UnsafePickleError,
    UnsupportedError,
    agree,
    is_safetensors,
    pair_sides,
    torch_load,
    write,
)

LAYOUTS = {
    kv_lingo_v1.LAYOUT: kv_lingo_v1,
    mapper_dir.LAYOUT: mapper_dir,
    linear_state_dict.LAYOUT: linear_state_dict,
}
#: Short names accepted on the command line.
ALIASES = {
    "v1": kv_lingo_v1.LAYOUT,
    "mapper": mapper_dir.LAYOUT,
    "linear": linear_state_dict.LAYOUT,
}

__all__ = [
    "LAYOUTS", "ChecksumError", "ConversionError", "Converted", "DirectionError", "GeometryMismatchError",
    "InvalidInputError", "MissingTensorError", "NonFiniteWeightError", "ShapeMismatchError",
    "UnexpectedTensorError", "UnknownSchemaError", "UnsafePickleError", "UnsupportedError",
    "convert", "convert_file", "detect_layout",
]  # fmt: skip


def detect_layout(path: str | Path) -> tuple[str, object]:
    """The layout of `path`, and the loaded PyTorch object when one had to be read to tell."""
    path = Path(path)
    if not path.exists():
        raise InvalidInputError(f"{path}: no such file or directory")
    if path.is_dir():
        if mapper_dir.looks_like(path):
            return mapper_dir.LAYOUT, None
        raise UnknownSchemaError(f"{path}: a directory without manifest.json/SHA256SUMS")
    if is_safetensors(path):
        return linear_state_dict.LAYOUT, None
    obj = torch_load(path)
    if kv_lingo_v1.looks_like(obj):
        return kv_lingo_v1.LAYOUT, obj
    if linear_state_dict.looks_like(obj):
        return linear_state_dict.LAYOUT, obj
    keys = sorted(map(str, obj))[:8] if isinstance(obj, dict) else type(obj).__name__
    raise UnknownSchemaError(
        f"{path}: unknown layout: neither a 'schema' dict nor k_maps/v_maps (top level: {keys})"
    )


def convert(path: str | Path, layout: str | None = None, pair=None, **options) -> Converted:
    """Read one PyTorch translator into a `Converted` (not yet written).

    `pair`: a loaded ModelPair whose geometry the conversion must match (and fills in what
    the input leaves out). `options` go to the layout's converter (see each module).
    """
    loaded = None
    if layout is None:
        layout, loaded = detect_layout(path)
    layout = ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise UnknownSchemaError(f"unknown layout {layout!r}; known: {sorted(LAYOUTS)}")
    if pair is not None:
        options["source"], options["target"] = _merge(options, pair)
        options["names"] = {"source": pair.source.name, "target": pair.target.name}
    return LAYOUTS[layout].convert(path, loaded=loaded, **options)


def _merge(options, pair):
    src, tgt = pair_sides(pair)
    return agree("source", options.get("source"), src), agree("target", options.get("target"), tgt)


def convert_file(
    path: str | Path, output: str | Path, layout: str | None = None, pair=None, **options
) -> tuple[Path, Converted]:
    """Convert and write our translator file (verified by loading it back)."""
    converted = convert(path, layout, pair, **options)
    return write(converted, output, pair), converted
