"""What the selective recompute costs in a chat: the TTFT of a documentation passage of about
N tokens ending "Summarize the passage in one sentence.", read by the small model for the large
one, at several recompute shares, beside the large model reading it itself (reader self). One
process, the settings interleaved round by round; medians:

    python -m weights.experiments.recompute_cost [--lengths 128,512] [--shares 0,0.05,0.1]
        [--rounds 3] [--pair dense]

The status line's parts are printed too (who read, what the recompute itself took).
"""

from __future__ import annotations

import argparse
import statistics

from mlx_kvlingo import ReaderPolicy, load, make_prompt_cache, stream_generate
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.models.demo.pair import demo_content_texts

ASK = " Summarize the passage in one sentence."


def passage(tokenizer, text: str, tokens: int) -> str:
    """The first `tokens` tokens of `text` (whole words)."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids).rsplit(" ", 1)[0] + ASK


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--shares", default="0,0.05,0.1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense")
    a = ap.parse_args(argv)
    pair = load(pair=a.pair)
    settings = [("self", 0.0), *(("small", float(s)) for s in a.shares.split(","))]
    docs = " ".join(read_texts(demo_content_texts()[0])[:40])  # held-out documentation
    texts = {int(n): passage(pair.tokenizer, docs, int(n)) for n in a.lengths.split(",")}
    ttft: dict = {}
    status: dict = {}
    for _ in range(a.rounds):
        for n, text in texts.items():
            for reader, share in settings:
                policy = ReaderPolicy(reader=reader, recompute_share=share)
                cache = make_prompt_cache(pair, policy=policy)
                *_, done = stream_generate(pair, text, prompt_cache=cache, max_tokens=1, seed=0)
                ttft.setdefault((n, reader, share), []).append(done.handoff.ttft_s)
                status[(n, reader, share)] = done.status
    print("| read tokens | reader | recompute | TTFT ms (median) |")
    print("| ---: | --- | ---: | ---: |")
    for (n, reader, share), xs in ttft.items():
        print(f"| {n} | {reader} | {share:g} | {statistics.median(xs) * 1000:.0f} |")
    print("\nThe last round's status lines:")
    for key, line in status.items():
        print(key, line)


if __name__ == "__main__":
    main()
