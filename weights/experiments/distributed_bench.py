"""Time and bytes per switch with the large model pipelined over 1 or 2 ranks, beside one process.

    mlx.launch --backend ring -n 2 --python python3 -- -m weights.experiments.distributed_bench --out b.json
    python -m weights.experiments.distributed_bench --distributed --out b.json   # 1 rank
    python -m weights.experiments.distributed_bench --out b.json                 # the single process
    python -m weights.experiments.distributed_bench --report b.json              # the markdown table

A switch, as a conversation has it (the public API's `load` and `stream_generate`, reader "small"): a user turn of
n tokens, the small model reads it, the span is translated into the large model's cache (on
2 ranks: each rank is sent what its layers need), the large model answers 16 tokens. Reported:
the switch (translation + transfer), the small model's read, the bytes sent to the other rank,
the large model's decode rate. Defaults to the demo pair; --source/--target/--translator for
others.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo import ReaderPolicy, load, make_prompt_cache, stream_generate
from mlx_kvlingo.api import Pair

SIZES = (64, 256, 1024)
ANSWER = 16


def tokens_for(n, vocab, seed=0):
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, n + 1)]


def bytes_sent(pair: Pair) -> int:
    """Bytes rank 0 has sent to the other ranks so far (0 in one process)."""
    return pair.link.bytes_sent if pair.link else 0


def bench(pair: Pair, wire: str, repeat: int) -> list[dict]:
    rows = []
    vocab = len(pair.tokenizer.get_vocab())
    policy = ReaderPolicy(reader="small")
    if pair.link:  # a pipelined large model cannot recompute
        policy = replace(policy, recompute_share=0.0)
    for n in SIZES:
        toks = tokens_for(n, vocab)
        switch, read, tps, sent = [], [], [], []
        for _ in range(repeat + 1):  # the first run warms up
            # reader "small": the whole turn of exactly n + 1 raw tokens is translated
            cache = make_prompt_cache(pair, policy=policy)
            before = bytes_sent(pair)
            *_, last = stream_generate(pair, toks, prompt_cache=cache, max_tokens=ANSWER, temp=0,
                                       seed=0)  # fmt: skip
            t = last.handoff
            translated = t.switch.translated if t.switch else 0
            switch.append(t.switch.seconds if translated else 0.0)
            read.append(t.prompt_tokens / t.prompt_tps if t.prompt_tps else 0.0)
            tps.append(t.generation_tps)
            sent.append(bytes_sent(pair) - before)
            print(f"{wire} {n}: switch {switch[-1]:.3f} s", file=sys.stderr, flush=True)
        rows.append({
            "ranks": pair.link.ranks if pair.link else "single process", "wire": wire,
            "tokens": translated, "switch_s": statistics.median(switch[1:]),
            "read_s": statistics.median(read[1:]), "decode_tps": statistics.median(tps[1:]),
            "bytes": sent[-1], "bytes_per_token": sent[-1] // max(translated, 1),
        })  # fmt: skip
    return rows


def report(path):
    rows = json.loads(Path(path).read_text())
    print("| ranks | wire | tokens | switch ms | small read ms | bytes sent | bytes/token | "
          "large decode tok/s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    key = {"single process": 0}
    for r in sorted(rows, key=lambda r: (r["tokens"], key.get(r["ranks"], r["ranks"]), r["wire"])):
        print(f"| {r['ranks']} | {r['wire']} | {r['tokens']} | {r['switch_s'] * 1e3:.1f} | "
              f"{r['read_s'] * 1e3:.1f} | {r['bytes']:,} | {r['bytes_per_token']:,} | "
              f"{r['decode_tps']:.1f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="distributed_bench.json")
    ap.add_argument("--report")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--distributed", action="store_true", help="1 rank through the distributed path"
    )
    ap.add_argument("--source")
    ap.add_argument("--target")
    ap.add_argument("--translator")
    args = ap.parse_args([a for a in (sys.argv[1:] if argv is None else argv) if a != "--"])
    if args.report:
        return report(args.report)
    from mlx_kvlingo.distributed.pipeline import launched

    distributed = args.distributed or launched()
    rows = []
    for wire in ("source", "target") if distributed else ("-",):
        kwargs = {"distributed": distributed, "wire": wire} if distributed else {}
        try:  # ranks > 0 serve inside load and leave it with SystemExit once rank 0 is done
            pair = load(args.source, args.target, args.translator, **kwargs)
        except SystemExit:
            continue
        t0 = time.perf_counter()
        rows += bench(pair, wire, args.repeat)
        print(f"{wire}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        pair.close()
    if rows:  # rank 0
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.exists() else []
        out.write_text(json.dumps(old + rows, indent=1))
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
