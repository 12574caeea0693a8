"""The demo pair's shipped files and how they are made: `weights.build` (the ordered build,
`python -m weights.build.rebuild`) and `weights.experiments` (measurements that ship nothing).
Not installed with the package: run from the repository root. The files the demo's defaults
load install as `mlx_kvlingo_demo` from the mlx-kvlingo-demo wheel (weights/wheel/)."""
