"""Which files the mlx-kvlingo-demo wheel ships: what the demo pairs' defaults in
weights/manifest.json load (the small model, forward and backward translators, which both pairs
share) and the manifest, plus the MoE target's recipe; superseded translators and the build do
not ship.
weights/ itself is the package (`mlx_kvlingo_demo`): nothing is copied or moved."""

import json
from pathlib import Path

from setuptools import setup

WEIGHTS = Path(__file__).resolve().parent.parent
#: what mlx_kvlingo/models/demo/moe.py builds the MoE target from (beside the dense target's GGUF)
MOE_FILES = ["moe/moe.json"]
#: what mlx_kvlingo/models/demo/smollm2.py assembles a demo source from
SOURCE_FILES = ["model.safetensors", "source.json"]


def demo_files() -> list[str]:
    manifest = json.loads((WEIGHTS / "manifest.json").read_text())
    files = {"manifest.json", *MOE_FILES}
    default = manifest["default"]
    files.update(f"{default['source']}/{name}" for name in SOURCE_FILES)
    files.update(f"translators/{default[d]}" for d in ("forward", "backward"))
    missing = sorted(f for f in files if not (WEIGHTS / f).is_file())
    if missing:
        raise SystemExit(f"the demo's default files are missing from {WEIGHTS}: {missing}")
    return sorted(files)


setup(
    packages=["mlx_kvlingo_demo"],
    package_dir={"mlx_kvlingo_demo": ".."},
    package_data={"mlx_kvlingo_demo": demo_files()},
)
