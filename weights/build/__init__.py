"""The demo's build: the ordered steps that make what `weights/` ships (the source's layers, the
MoE target's recipe, every translator, the held-out text slices, `manifest.json` and the
generated sections of `QUALITY.md`).

`python -m weights.build.rebuild` runs them in order (`--dry-run`: the plan; `--list`; `--only`,
`--from`, `--pair dense|moe`); `rebuild.STEPS` fixes the order and each step's arguments. Each
step is a module here with `main(argv)` (and `parser()`), also runnable alone as
`python -m weights.build.<module>`. Helpers the steps share: `manifest` (the one writer of
`manifest.json`), `quality_md` (one section of `QUALITY.md`), `translator_build` (what the
translator step does per fitted translator). Experiments whose output is not shipped live in
`weights/experiments/`.
"""
