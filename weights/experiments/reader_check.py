"""Three unrelated questions in one demo conversation, answered by the large model, with the
small model reading every turn (`--reader small`), the large reading itself (`--reader self`)
or the default policy (`--reader auto`: the small reads the opening and long turns): a quick
look at what the reader mode's deviation does to later answers.

    python -m weights.experiments.reader_check --reader small
    python -m weights.experiments.reader_check --reader self
"""

from __future__ import annotations

import argparse

from mlx_kvlingo import ReaderPolicy, generate, load, make_prompt_cache

QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "What is 12 times 3?",
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reader", choices=("auto", "tokens", "small", "self"), default="auto")
    ap.add_argument("--translator", help="a shipped forward translator file (default: the demo's)")
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args(argv)
    pair = load(translator=args.translator)
    for seed in (int(s) for s in args.seeds.split(",")):
        cache = make_prompt_cache(pair, policy=ReaderPolicy(reader=args.reader))
        for q in QUESTIONS:
            answer = generate(pair, q, prompt_cache=cache, seed=seed)
            print(f"[seed {seed}] {q}\n    -> {answer[:200]}")


if __name__ == "__main__":
    main()
