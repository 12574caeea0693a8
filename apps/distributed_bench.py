"""Time and bytes per switch with the target pipelined over 1 or 2 ranks, beside one process.

    mlx.launch --backend ring -n 2 --python python3 apps/distributed_bench.py --out b.json
    python apps/distributed_bench.py --out b.json          # 1 rank, and the single process
    python apps/distributed_bench.py --report b.json       # the markdown table

A switch: the source prefills n prompt tokens, they are translated and placed on the ranks
owning each target layer. Defaults to the demo pair; --source/--target/--translator for others.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo import distributed as dist

import mlx.core as mx

SIZES = (64, 256, 1024)


def tokens_for(n, vocab, seed=0):
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, n + 1)]


def bench_ranks(args, group):
    from mlx_kvlingo.demo.pair import demo_models, translator_path

    src, tgt = (args.source, args.target) if args.source else demo_models()
    path = args.translator or translator_path()
    rows = []
    for wire in ("source", "target"):
        sp = dist.load_sharded_pair(src, tgt, path, group, wire=wire)
        vocab = len(sp.tokenizer.get_vocab())
        for n in SIZES:
            toks = tokens_for(n, vocab)
            times, prefill = [], []
            for _ in range(args.repeat + 1):
                mx.eval(dist._broadcast(mx.array(0.0), group, 60))  # start together
                t0 = time.perf_counter()
                h = dist.handoff(sp, toks)
                times.append(time.perf_counter() - t0)
                prefill.append(h.source_prefill_s)
            rows.append({
                "ranks": sp.size, "wire": wire, "tokens": n, "switch_s": statistics.median(times[1:]),
                "prefill_s": statistics.median(prefill[1:]), "bytes": h.bytes_sent,
                "bytes_per_token": h.bytes_sent // n, "owners": [[o.start, o.stop] for o in sp.owners],
            })  # fmt: skip
    return rows


def bench_single(args):
    from mlx_kvlingo.decode import handoff
    from mlx_kvlingo.demo.pair import load_demo
    from mlx_kvlingo.format import load_translator
    from mlx_kvlingo.pair import load_pair

    if args.source:
        pair = load_pair(args.source, args.target)
        tr = load_translator(args.translator, pair)
    else:
        pair, tr = load_demo(args.translator)
    rows = []
    for n in SIZES:
        toks = tokens_for(n, len(pair.tokenizer.get_vocab()))
        times, prefill = [], []
        for _ in range(args.repeat + 1):
            t0 = time.perf_counter()
            h = handoff(pair, tr, toks)
            times.append(time.perf_counter() - t0)
            prefill.append(h.source_prefill_s)
        rows.append({"ranks": "single process", "wire": "-", "tokens": n, "bytes": 0,
                     "switch_s": statistics.median(times[1:]), "bytes_per_token": 0,
                     "prefill_s": statistics.median(prefill[1:])})  # fmt: skip
    return rows


def report(path):
    rows = json.loads(Path(path).read_text())
    print(
        "| ranks | wire | tokens | switch ms | of which source prefill ms | bytes sent | bytes/token |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    key = {"single process": 0}
    for r in sorted(rows, key=lambda r: (r["tokens"], key.get(r["ranks"], r["ranks"]), r["wire"])):
        print(f"| {r['ranks']} | {r['wire']} | {r['tokens']} | {r['switch_s'] * 1e3:.1f} | "
              f"{r['prefill_s'] * 1e3:.1f} | {r['bytes']:,} | {r['bytes_per_token']:,} |")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="distributed_bench.json")
    ap.add_argument("--report")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--source")
    ap.add_argument("--target")
    ap.add_argument("--translator")
    args = ap.parse_args([a for a in sys.argv[1:] if a != "--"])
    if args.report:
        return report(args.report)
    group = dist.init()
    rows = bench_ranks(args, group)
    if group.size() == 1:
        rows += bench_single(args)
    if group.rank() == 0:
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.exists() else []
        out.write_text(json.dumps(old + rows, indent=1))
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
