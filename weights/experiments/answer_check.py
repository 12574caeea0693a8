"""Do answers from translated caches say what the target would have said? A user-level check.

For held-out assistant conversations (weights/build/assistant_data.py: everyday questions on
subjects never calibrated on, some with 2-3 unrelated questions in a row) the large model
answers every question twice, greedily (repetition penalty 1.1 given explicitly): once reading
the conversation itself (`reader="self"`, the native answer) and once with the small model
reading every user turn for it (`reader="small"`, answers from translated caches; `--reader
auto`: the chat's default policy, the small model reads only first and long turns). Reported,
for first questions (one translated span) and for later ones (translated spans after native
answers: the reader mode's mixed cache):
  same start   share of answers whose first 6 words equal the native answer's
  word recall  mean share of the native answer's content words (4+ letters) in the answer
Plus a keyword quiz (`quiz.py`: ten everyday questions, one must-have word each)
answered from translated caches.

`--long-later`: instead, conversations of a quiz question, then a held-out documentation
paragraph (64+ tokens) to summarize: the later turn that `auto` still translates.

    python -m weights.experiments.answer_check --pair dense -n 40
    python -m weights.experiments.answer_check --pair moe --translator FILE -n 40
    python -m weights.experiments.answer_check --long-later --reader auto -n 10
    python -m weights.experiments.answer_check --long-later --reader auto -n 10 --later-from-history
    python -m weights.experiments.answer_check --long-later --reader auto -n 10 --no-backward
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from pathlib import Path

from mlx_kvlingo import Conversation, ReaderPolicy, generate, load
from mlx_kvlingo.models.demo import pair as demo
from mlx_kvlingo.models.demo.smollm2 import cache_root, weights_dir

from weights.experiments.quiz import EVERYDAY_QUIZ, is_right

STOP = set("that this with from have your what when they them their there which about would "
           "could should also into more most some such than then these those will been were "
           "here just like make many much only other over very".split())  # fmt: skip


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def content(text: str) -> set[str]:
    return {w for w in words(text) if len(w) >= 4 and w not in STOP}


def compare(native: str, translated: str) -> dict:
    ref = content(native)
    recall = len(ref & content(translated)) / len(ref) if ref else 1.0
    return {"same_start": words(native)[:6] == words(translated)[:6], "recall": recall}


def long_later_conversations(path: Path) -> list[list[dict]]:
    """A quiz question, then "summarize" over each held-out paragraph of 350-900 characters."""
    paras = []
    for line in path.read_text().splitlines():
        for p in json.loads(line)["text"].split("\n\n"):
            p = " ".join(p.split())
            if 350 < len(p) < 900 and not p.startswith((">>>", "...")):
                paras.append(p)
    first = [q for q, _ in EVERYDAY_QUIZ]
    return [
        [
            {"role": "user", "content": first[i % len(first)]},
            {"role": "user", "content": f"Summarize this in one sentence: {p}"},
        ]
        for i, p in enumerate(paras)
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense")
    ap.add_argument("--translator", help="forward translator file (default: the pair's)")
    ap.add_argument("--data", type=Path, default=cache_root() / "data/assistant/heldout.jsonl")
    ap.add_argument("-n", "--conversations", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--reader", choices=("small", "auto", "tokens"), default="small",
                    help="the translated side's reader policy: small (every turn translated: "
                    "the translators' check), auto (what a chat does by default: by this "
                    "machine's timing) or tokens (the token rule, auto before issue 28)")  # fmt: skip
    ap.add_argument("--large-reads-last", type=int, default=ReaderPolicy().large_reads_last,
                    help="where the small model reads, the large still reads the turn's last this "
                    "many tokens itself (the default policy's); 1: the last token only")  # fmt: skip
    ap.add_argument("--recompute", type=float, default=0.0,
                    help="and recomputes this share of the translated turn (0, the figures "
                    "documented before the recompute; the default policy's is 0.1)")  # fmt: skip
    ap.add_argument("--long-later", action="store_true",
                    help="a quiz question, then a held-out paragraph to summarize")  # fmt: skip
    ap.add_argument("--prose", type=Path,
                    default=weights_dir() / "data/pydocs-prose-heldout.jsonl")  # fmt: skip
    ap.add_argument("--later-from-history", action="store_true",
                    help="ask each later question in a fresh conversation given the native one so "
                    "far as history: all of it translated at once, no mixed cache")  # fmt: skip
    ap.add_argument("--no-backward", action="store_true",
                    help="no backward translator: the small re-reads the large's answers")  # fmt: skip
    args = ap.parse_args(argv)
    data = args.prose if args.long_later else args.data
    if not data.is_file():  # before loading the pair: say what builds it
        ap.error(
            f"{data} does not exist: build the held-out conversations with "
            "`OPENBLAS_NUM_THREADS=1 python -m weights.build.assistant_data --train 400 "
            "--heldout 80` (about 14 min) or pass --data FILE"
        )

    source, target = demo.demo_models(args.pair)
    forward = args.translator or demo.translator_path(pair=args.pair)
    backward = None if args.no_backward else demo.translator_path(reverse=True, pair=args.pair)
    pair = load(source, target, forward, backward)
    greedy = {"temp": 0.0, "repetition_penalty": 1.1, "max_tokens": args.max_tokens}

    policy = ReaderPolicy(reader=args.reader, large_reads_last=args.large_reads_last,
                          recompute_share=args.recompute)  # fmt: skip

    def ask(conv: Conversation, q: str) -> str:
        return generate(pair, q, prompt_cache=conv.cache, **greedy)

    if args.long_later:
        convs = long_later_conversations(args.prose)
    else:
        convs = [json.loads(line)["messages"] for line in args.data.read_text().splitlines()]
    rows = {"first": [], "later": []}
    examples = []
    t0 = time.perf_counter()
    for msgs in convs[: args.conversations]:
        native = Conversation(pair, policy=ReaderPolicy(reader="self"))
        translated = Conversation(pair, policy=policy)
        for turn, q in enumerate(m["content"] for m in msgs if m["role"] == "user"):
            if args.later_from_history and turn > 0:
                translated = Conversation(pair, policy=policy)
                translated.add_messages(native.messages)
            a, b = ask(native, q), ask(translated, q)
            rows["first" if turn == 0 else "later"].append(compare(a, b))
            if len(examples) < 6 and turn > 0:
                examples.append({"question": q, "native": a, "translated": b})
    quiz = []
    for q, must in EVERYDAY_QUIZ:
        quiz_conv = Conversation(pair, policy=replace(policy, reader=None))
        quiz.append(is_right(ask(quiz_conv, q), must))
    result = {
        "pair": args.pair,
        "translator": Path(str(forward)).name,
        "reader": args.reader,
        "large_reads_last": args.large_reads_last,
        "recompute_share": args.recompute,
        "later_from_history": args.later_from_history,
        "backward_translator": backward is not None,
        "conversations_of": "quiz question, paragraph to summarize" if args.long_later else "data",
        "conversations": min(len(convs), args.conversations),
        **{
            k: {
                "questions": len(v),
                "same_start": sum(r["same_start"] for r in v) / max(len(v), 1),
                "word_recall": sum(r["recall"] for r in v) / max(len(v), 1),
            }
            for k, v in rows.items()
        },
        "quiz_right": f"{sum(quiz)}/{len(quiz)}",
        "seconds": round(time.perf_counter() - t0),
        "later_examples": examples,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
