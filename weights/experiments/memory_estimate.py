"""The memory estimate made before loading a pair, against what loading it really takes.

    python -m weights.experiments.memory_estimate                     # the demo pair and the presets
    python -m weights.experiments.memory_estimate --pairs demo,tiny

For each pair, in a fresh process: `pair.estimate_bytes` of both model folders (what
`load_pair` checks against the machine's memory before loading anything), then the pair is
loaded (float32 on a CPU, as `kvlingo` loads it), and MLX's peak memory is read after loading
and after both models read a prompt of `--tokens` tokens. A pair whose estimate exceeds what
the machine has is refused (`InsufficientMemoryError`, naming both numbers) and not loaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: the folder holding this mlx_kvlingo: each child runs from it, so it imports the same package
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
import mlx_kvlingo
import mlx.core as mx
from mlx_kvlingo.models.pair import estimate_bytes, load_pair, physical_memory, InsufficientMemoryError
from mlx_kvlingo.kv.cache import new_cache
name, tokens = sys.argv[1], int(sys.argv[2])
if name == "demo":
    from mlx_kvlingo.models.demo.pair import demo_models
    src, tgt = demo_models()
else:
    from mlx_kvlingo.eval.presets import build_preset
    folder = build_preset(name)
    src, tgt = folder / "source", folder / "target"
est = [estimate_bytes(src), estimate_bytes(tgt)]
out = {"pair": name, "estimate": sum(est), "estimate_source": est[0], "estimate_target": est[1],
       "machine": physical_memory()}
mx.reset_peak_memory()
try:
    pair = load_pair(src, tgt)
except InsufficientMemoryError as e:
    out["refused"] = str(e)
    print(json.dumps(out)); sys.exit(0)
out["weights"] = pair.source.nbytes() + pair.target.nbytes()
out["peak_load"] = mx.get_peak_memory()
ids = mx.array([list(range(10, 10 + tokens))])
for m in (pair.source, pair.target):
    cache = new_cache(m)
    mx.eval(m.model(ids, cache=cache))
    del cache
out["peak_prefill"] = mx.get_peak_memory()
out["tokens"] = tokens
print(json.dumps(out))
"""


def gib(n) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "-"


def main(argv=None) -> int:
    from mlx_kvlingo.eval.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", default=",".join(["demo", *PRESETS]))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for name in args.pairs.split(","):
        r = subprocess.run([sys.executable, "-c", CHILD, name, str(args.tokens)],
                           capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        if r.returncode:
            print(f"{name}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"| pair | estimate before loading (GiB) | weights loaded (GiB) | peak after loading "
          f"(GiB) | peak after a {args.tokens}-token prefill (GiB) | estimate / peak |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['pair']} | {gib(r['estimate'])} | refused: {r['refused']} | | | |")
            continue
        print(f"| {r['pair']} | {gib(r['estimate'])} | {gib(r['weights'])} | {gib(r['peak_load'])} "
              f"| {gib(r['peak_prefill'])} | {r['estimate'] / r['peak_prefill']:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
