"""Reader `auto` on the README's third chat turn: the cat question, the capital of Japan, then a
90-word passage to summarize, answered by the large model under readers auto, self and small,
in one process, rounds interleaved. Prints each passage turn's TTFT, who read it, and the TTFT
predicted for the path not taken (the status line's figure):

    python -m weights.experiments.passage_turn_timing [--rounds 2]

It checks the status line's "large alone: TTFT ≈ ..." against the large model reading that
turn itself (reader self) (mlx_kvlingo/conversation/READER_TIMING.md, "Not met, or not shown").
"""

from __future__ import annotations

import argparse

from mlx_kvlingo import ReaderPolicy, load, make_prompt_cache, stream_generate

from .passage_words import PASSAGE

TURNS = ("Hi! Can you suggest a name for my cat?", "What is the capital of Japan?", PASSAGE)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    pair = load()
    print("| round | reader | read by | TTFT ms | other path predicted ms |")
    print("| ---: | --- | --- | ---: | ---: |")
    for r in range(a.rounds):
        for reader in ("auto", "self", "small"):
            cache = make_prompt_cache(pair, policy=ReaderPolicy(reader=reader))
            for text in TURNS:
                *_, last = stream_generate(pair, text, prompt_cache=cache, max_tokens=40, seed=0)
            t = last.handoff
            who = "small" if t.read and t.read.tokens else "large"
            print(f"| {r} | {reader} | {who} | {ms(t.ttft_s)} | {ms(t.alternative_ttft_s)} |")


if __name__ == "__main__":
    main()
