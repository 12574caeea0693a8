"""Where translation time goes, before and after the copy-free path, against the same GEMM.

    python -m weights.experiments.translation_profile --preset "qwen3-0.6b>qwen3-30b-a3b-scaled"
    python -m weights.experiments.translation_profile --preset tiny --lengths 64,256,1024 --rounds 9

Times the translation of a random span of n tokens into a fresh target cache (what `kvlingo
bench` calls "translation": maps, k_norm/RoPE/cast, cache writes) along two code paths in the
same process, rounds interleaved: `after` is `Translator.translate` as it is (on the CPU: the
sums, bias, k_norm's weights and RoPE in one compiled pass); `composed` is the same maps then
`Translator.finish`, step by step, as before that pass; `before` is the
previous implementation, kept here only (a per-target-layer gather of the source, a copying
transpose, the composed `mx.fast.rope` of the CPU backend). `gemm` is the plain batched matmul
of the same shapes (`bench.gemm_operands`); efficiency = gemm time / path time, the bench's
figure. Only the translator and the target's RoPE/k_norm are used, so the target's weights are
loaded lazily and never read (the preset's models need no RAM here).
"""

from __future__ import annotations

import argparse
import time

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.eval.bench import gemm_operands, kernel_work
from mlx_kvlingo.eval.presets import build_preset
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.capture import SpanKV
from mlx_kvlingo.kv.translator import target_dtype
from mlx_kvlingo.models import pair as pair_module

import mlx.core as mx
import numpy as np


def before_maps(tr, span):
    """The maps as they were before issue 15: per target layer a gathered copy of its source
    layers, then a copying transpose, then the batched matmul."""

    def map_features(x, kind):
        params = tr.key if kind == "key" else tr.value
        index = mx.array(tr.config.key_layers if kind == "key" else tr.config.value_layers)
        w = params["weight"]
        Lt, nu = index.shape
        Ls, B, Hs, T, D = x.shape
        x = x.astype(w.dtype)[index.reshape(-1)].reshape(Lt, nu, B, Hs, T, D)
        if tr.config.variant == "mixing":
            x = x.transpose(0, 2, 4, 1, 3, 5).reshape(Lt, B * T, nu * Hs * D)
            y = x @ w
            if "bias" in params:
                y = y + params["bias"][:, None, :]
            Ht = tr.config.target.kv_heads
            return y.reshape(Lt, B, T, Ht, -1).transpose(0, 1, 3, 2, 4)
        x = x.transpose(0, 3, 2, 4, 1, 5).reshape(Lt, Hs, B * T, nu * D)
        y = x @ w
        if "bias" in params:
            y = y + params["bias"][:, :, None, :]
        return y.reshape(Lt, Hs, B, T, -1).transpose(0, 2, 1, 3, 4)

    return map_features(span.keys, "key"), map_features(span.values, "value")


def before_translate(tr, span, target):
    """The whole translation before issue 15: `before_maps`, then the target's RoPE module
    (on the CPU, MLX's composed `mx.fast.rope`), then the cast. No native first token."""
    keys, values = before_maps(tr, span)
    keys = keys.astype(mx.float32)
    if tr.config.key_cut == "pre_norm" and target.geometry.has_k_norm:
        keys = mx.stack([target.attention(t).k_norm(keys[t]) for t in range(keys.shape[0])])
    Lt, B, H, T, D = keys.shape
    keys = target.rope(keys.reshape(Lt * B, H, T, D), offset=span.start).reshape(Lt, B, H, T, D)
    dtype = target_dtype(target)
    keys = keys if keys.dtype == dtype else keys.astype(dtype)
    values = values if values.dtype == dtype else values.astype(dtype)
    return list(keys), list(values)


def load_lazily(name: str):
    """(pair, translator) of a preset with the models' weights mapped but never read; for
    "dense" or "moe", the demo pair (loaded as usual)."""
    from mlx_kvlingo.models.files import load_translator

    if name in ("dense", "moe"):
        from mlx_kvlingo.models.demo.pair import load_demo

        return load_demo(pair=name)

    folder = build_preset(name, log=print)
    load = pair_module.mlx_lm_load
    pair_module.mlx_lm_load = lambda path, **kw: load(path, lazy=True, **kw)
    try:
        pair = pair_module.load_pair(folder / "source", folder / "target", dtype=None)
    finally:
        pair_module.mlx_lm_load = load
    return pair, load_translator(folder / "translator.safetensors", pair)


def profile(pair, tr, n: int, rounds: int) -> dict:
    s = pair.source.geometry
    mx.random.seed(n)
    shape = (s.layers, 1, s.kv_heads, n, s.head_dim)
    span = SpanKV(mx.random.normal(shape), mx.random.normal(shape), start=17)
    mx.eval(span.keys, span.values)
    gemm_in = gemm_operands(tr, n)

    def into_cache(fn):
        def run():
            cache = new_cache(pair.target)
            append_kv(cache, *fn(tr, span, pair.target))

        return run

    def after(tr, span, target):
        return tr.translate(span, target)

    def composed(tr, span, target):  # the maps, then the target-side steps, unfused
        return tr.finish(*tr(span), span, target)

    phases = {
        "gemm": lambda: mx.eval([a @ w for a, w in gemm_in]),
        "before": into_cache(before_translate),
        "after": into_cache(after),
        "composed": into_cache(composed),
        "before: maps": lambda: mx.eval(before_maps(tr, span)),
        "after: maps": lambda: mx.eval(tr(span)),
        "after: maps + finish": lambda: mx.eval(tr.translate(span, pair.target)),
    }
    a, b = before_translate(tr, span, pair.target), tr.translate(span, pair.target)
    same = all(mx.array_equal(x, y).item() for x, y in zip(a[0] + a[1], b[0] + b[1]))
    times = {k: [] for k in phases}
    for r in range(rounds + 1):  # round 0 warms up; the order alternates by round
        for k in list(phases) if r % 2 else list(phases)[::-1]:
            t0 = time.perf_counter()
            phases[k]()
            if r:
                times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    # per-round ratios: a loaded machine slows whole rounds; a ratio within a round cancels it
    eff = {k: float(np.median(np.divide(times["gemm"], times[k])))
           for k in ("before", "after", "composed")}  # fmt: skip
    speedup = float(np.median(np.divide(times["before"], times["after"])))
    flops, _ = kernel_work(tr, n)
    return {"n": n, "median_s": med, "efficiency": eff, "speedup": speedup,
            "bitwise_equal": same, "flops": flops}  # fmt: skip


def markdown(name: str, results: list[dict]) -> str:
    out = [
        f"`{name}`: median ms over the rounds; efficiency = GEMM time / path time and speed-up "
        "= before / after, medians of the per-round ratios",
        "",
        "| n | GEMM ms | before ms | after ms | before eff. | after eff. | speed-up | "
        "maps: before / after ms | after: maps + finish ms | composed ms (eff.) | bitwise equal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        m = {k: 1e3 * v for k, v in r["median_s"].items()}
        out.append(
            f"| {r['n']} | {m['gemm']:.1f} | {m['before']:.1f} | {m['after']:.1f} | "
            f"{100 * r['efficiency']['before']:.0f}% | {100 * r['efficiency']['after']:.0f}% | "
            f"{r['speedup']:.2f}x | {m['before: maps']:.1f} / {m['after: maps']:.1f} | "
            f"{m['after: maps + finish']:.1f} | {m['composed']:.1f} "
            f"({100 * r['efficiency']['composed']:.0f}%) | {'yes' if r['bitwise_equal'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b>qwen3-30b-a3b-scaled",
                    help="a preset's name, or dense / moe for a demo pair")  # fmt: skip
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    pair, tr = load_lazily(args.preset)
    results = []
    for n in (int(v) for v in args.lengths.split(",")):
        results.append(profile(pair, tr, n, args.rounds))
        print(f"n={n} done", flush=True)
    print(markdown(args.preset, results))


if __name__ == "__main__":
    main()
