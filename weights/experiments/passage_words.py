"""How much of a one-sentence summary comes from the passage it summarizes, with the chat's
default sampling (seeds 0..N-1), the large model reading the passage itself and the small model
reading it for the large one:

    python -m weights.experiments.passage_words [--seeds 6] [--pair dense]

Share = content words (4+ letters) of the answer that occur in the passage, averaged over seeds.
It showed the repetition penalty pushing answers away from the passage's words while it covered
the user's text (mlx_kvlingo/conversation/README.md, "Sampling").
"""

from __future__ import annotations

import argparse
import re

from mlx_kvlingo import ReaderPolicy, generate, load, make_prompt_cache

PASSAGE = (
    "The Industrial Revolution began in Britain in the late eighteenth century. Water and then "
    "steam power drove new machines in textile mills, and iron production grew as coke replaced "
    "charcoal. Canals and later railways carried coal and goods across the country, and workers "
    "moved from farms into fast-growing cities such as Manchester. Wages rose slowly, while "
    "working hours were long and conditions in factories were often dangerous, which led to the "
    "first factory laws in the 1830s. Summarize the passage in one sentence."
)


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense")
    a = ap.parse_args(argv)
    pair = load(pair=a.pair)
    passage = words(PASSAGE)
    for reader in ("self", "small"):
        shares = []
        for seed in range(a.seeds):
            cache = make_prompt_cache(pair, policy=ReaderPolicy(reader=reader))
            answer = words(generate(pair, PASSAGE, prompt_cache=cache, max_tokens=40, seed=seed))
            shares.append(len(answer & passage) / max(len(answer), 1))
        each = " ".join(f"{x:.2f}" for x in shares)
        print(f"reader {reader}: {sum(shares) / len(shares):.2f} of the answer's words ({each})")


if __name__ == "__main__":
    main()
