"""Prefill and decode cost of the demo's MoE target (SmolLM2-135M-MoE, qwen3_moe, 8 experts
top-2, each a copy of the dense MLP) against the dense SmolLM2-135M-Instruct, side by side.

    python -m weights.experiments.moe_vs_dense [--lengths 128,512] [--trials 3] [--decode 16]

Every round times every model at every length in an order that alternates by round (noise on
a shared machine hits all alike); one warm-up round is discarded; medians are reported. The
MoE is timed twice for prefill: mlx-lm's own path (`gather_mm`) and `moe_cpu.per_expert_loop`
(one GEMM per expert; same function). Decode is per token with a KV cache after the prefill.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.models.demo.moe import ensure_smollm2_moe
from mlx_kvlingo.models.demo.smollm2 import ensure_smollm2

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


def prefill_and_decode(model, tokens: list[int], decode: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decoded token) for one prompt."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    t1 = time.perf_counter()
    y = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(decode):
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
    return t1 - t0, (time.perf_counter() - t1) / decode


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    dense, _ = mlx_lm.load(str(ensure_smollm2(dequantize=True)))
    moe, _ = mlx_lm.load(str(ensure_smollm2_moe()))
    runs = {"dense": (dense, False), "moe gather_mm": (moe, False), "moe per-expert": (moe, True)}
    rng = np.random.default_rng(0)
    times = {(r, n): [] for r in runs for n in lengths}
    for rnd in range(args.trials + 1):
        order = list(runs) if rnd % 2 == 0 else list(reversed(runs))
        for n in lengths:
            tokens = rng.integers(100, 40000, n).tolist()
            for r in order:
                model, loop = runs[r]
                with moe_cpu.per_expert_loop(loop):
                    t = prefill_and_decode(model, tokens, args.decode)
                if rnd:  # round 0 warms up
                    times[(r, n)].append(t)
    rows = ["| model | prompt tokens | prefill ms | prefill vs dense | decode ms/token | decode vs dense |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    out = {}
    for n in lengths:
        base = np.median(times[("dense", n)], axis=0)
        for r in runs:
            p, d = np.median(times[(r, n)], axis=0)
            out[f"{r}@{n}"] = {"prefill_s": p, "decode_s_per_token": d, "trials": times[(r, n)]}
            rows.append(f"| {r} | {n} | {1e3 * p:.0f} | {p / base[0]:.2f}x | {1e3 * d:.1f} | {d / base[1]:.2f}x |")  # fmt: skip
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
