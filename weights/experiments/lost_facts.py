"""Lost facts of long documents: did the chat's recompute take the fact, and would it help?

    python -m weights.experiments.lost_facts STEPS [--length 4096] [--seed 100] [--oracle]

For the `long_documents` items of the given steps (kind `fact`, seed `--seed` + step), the
chat's hand-off (`content.chat_kv`: the small model reads, the span is translated, the large
model reads the tail and recomputes) runs with `kv.recompute.attended` watched. Per step, one
JSON line: the positions recomputed (`count`), how many of the fact's tokens are among them
(`covered`), and the rank of the fact's best token and of its sentence's best token by the
question's attention (`best_fact_rank`, `best_sentence_rank`; 0 = the first peak). With
`--oracle`, the chat's answer is also taken with the fact's whole sentence recomputed on top
(then the tail read again): right there and wrong without means the selection missed it.
"""

from __future__ import annotations

import argparse
import json

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.conversation import session
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import Chat, chat_kv, evaluate_content, fitting_tasks
from mlx_kvlingo.kv import recompute
from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo

import mlx.core as mx


def first_token_past(tokenizer, tokens, chars: int) -> int:
    """The first i whose prefix tokens[: i + 1] decodes to more than `chars` characters."""
    lo, hi = 0, len(tokens) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[: mid + 1])) > chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def fact_positions(tokenizer, tokens, answer: str) -> list[int]:
    k = tokenizer.decode(tokens).find(answer)
    if k < 0:
        return []
    a = first_token_past(tokenizer, tokens, k)
    b = first_token_past(tokenizer, tokens, k + len(answer) - 1)
    return list(range(a, b + 1))


def sentence_of(positions, tokens, ends) -> range:
    a, b = positions[0], positions[-1]
    while a > 0 and tokens[a - 1] not in ends:
        a -= 1
    while b + 1 < len(tokens) and tokens[b] not in ends:
        b += 1
    return range(a, b + 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--oracle", action="store_true")
    args = ap.parse_args()
    pair, tr = load_demo(pair="dense")
    tok = pair.tokenizer
    texts = [t for p in demo_content_texts() for t in read_texts(p)]
    seen: dict = {}
    attended, recompute_attended = recompute.attended, session.recompute_attended

    def watched(mass, count, start=0, end=None, **kw):
        chosen = attended(mass, count, start=start, end=end, **kw)
        end = mass.shape[0] if end is None else end
        order = (mx.argsort(-mass[start + 1 : end]) + start + 1).tolist()
        rank = {p: i for i, p in enumerate(order)}
        fact = seen["fact"]
        sentence = sentence_of(fact, kw["tokens"], kw["ends"])
        seen.update(count=len(chosen), covered=len(set(fact) & set(chosen)),
                    best_fact_rank=min(rank.get(p, len(order)) for p in fact),
                    best_sentence_rank=min(rank.get(p, len(order)) for p in sentence),
                    sentence=len(sentence))  # fmt: skip
        return chosen

    def with_sentence(model, cache, tokens, tail, share, *a, **kw):
        chosen = recompute_attended(model, cache, tokens, tail, share, *a, **kw)
        sentence = sentence_of(seen["fact"], tokens, recompute.sentence_ends(tok))
        extra = sorted(set(sentence) - set(chosen))
        if extra:
            cut = max(1, len(tokens) - tail)
            recompute.read_positions(model, cache, tokens, extra)
            recompute.read_positions(model, cache, tokens, range(cut, len(tokens)))
        return chosen

    recompute.attended = watched
    for step in map(int, args.steps.split(",")):
        (task,) = fitting_tasks(
            pair, texts, [args.length], 1, seed=args.seed + step, kinds=["fact"]
        )
        seen.clear()
        seen["fact"] = fact_positions(tok, list(task.tokens), task.answer)
        out = {"step": step, "answer": task.answer, "depth": task.depth}
        if not seen["fact"]:
            print(json.dumps({**out, "error": "the answer is not in the prompt"}), flush=True)
            continue
        if args.oracle:
            for label, fn in (("chat", recompute_attended), ("chat+sentence", with_sentence)):
                session.recompute_attended = fn
                res = evaluate_content(pair, [task], {label: Chat(tr)}, small=False)
                r = next(x for x in res.records if x["condition"] == label)
                out[label] = {"correct": r["correct"], "reply": r["reply"][:60]}
            session.recompute_attended = recompute_attended
        else:
            chat_kv(pair, Chat(tr), task)
        fact = seen.pop("fact")
        print(json.dumps({**out, "fact_tokens": fact, **seen}), flush=True)


if __name__ == "__main__":
    main()
