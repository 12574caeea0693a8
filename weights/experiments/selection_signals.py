"""Where the fact's sentence ranks among a long document's sentences, by each reader's attention.

    python -m weights.experiments.selection_signals STEPS [--length 4096] [--seed 100]

For the `long_documents` items of the given steps (kind `fact`), the chat's hand-off runs (the
large model reads the last tokens over the translated span) and the small model reads the same
last tokens over its own cache of the document. Each sentence of the span is scored by the
largest (`_max`) and the summed (`_sum`) attention of the large model's reading (`T_`, what the
recompute chose by before `Selection.votes`) and of the small model's (`S_`), and by the words
it shares with the question, weighted by their rarity among the sentences (`lex`). One JSON line
per step: the fact's sentence's rank under each (0 = first).
"""

from __future__ import annotations

import argparse
import json
import math

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import Chat, chat_kv, fitting_tasks
from mlx_kvlingo.kv import recompute
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import prefill
from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo

from weights.experiments.lost_facts import fact_positions


def sentences(tokens, lo: int, hi: int, ends) -> list[range]:
    out, a = [], lo
    for i in range(lo, hi):
        if tokens[i] in ends:
            out.append(range(a, i + 1))
            a = i + 1
    return out + ([range(a, hi)] if a < hi else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()
    pair, tr = load_demo(pair="dense")
    tok = pair.tokenizer
    texts = [t for p in demo_content_texts() for t in read_texts(p)]
    ends, specials = recompute.sentence_ends(tok), recompute.special_ids(tok)
    seen, attended = {}, recompute.attended

    def watched(mass, count, start=0, end=None, **kw):
        seen.update(mass=mass, start=start, end=end)
        return attended(mass, count, start=start, end=end, **kw)

    recompute.attended = watched
    for step in map(int, args.steps.split(",")):
        (task,) = fitting_tasks(
            pair, texts, [args.length], 1, seed=args.seed + step, kinds=["fact"]
        )
        toks = list(task.tokens)
        fact = fact_positions(tok, toks, task.answer)
        chat_kv(pair, Chat(tr, share=0.1), task)
        mass, cut = seen["mass"], seen["end"]
        T = mass.shape[0]
        sents = sentences(toks, seen["start"] + 1, cut, ends)
        fi = next(i for i, s in enumerate(sents) if fact[0] in s)
        own = new_cache(pair.source)
        prefill(pair.source, toks[:T], own)
        small = recompute.read_positions(pair.source.model, own, toks[:T], range(cut, T), True)
        question = set(toks[cut:T]) - specials - ends
        df: dict[int, int] = {}
        for s in sents:
            for t in {toks[i] for i in s}:
                df[t] = df.get(t, 0) + 1
        idf = {t: math.log(len(sents) / n) for t, n in df.items()}
        m, sm = mass.tolist(), small.tolist()
        scores = {
            "T_max": [max(m[i] for i in s) for s in sents],
            "T_sum": [sum(m[i] for i in s) for s in sents],
            "S_max": [max(sm[i] for i in s) for s in sents],
            "S_sum": [sum(sm[i] for i in s) for s in sents],
            "lex": [sum(idf[t] for t in {toks[i] for i in s} & question) for s in sents],
        }
        ranks = {k: sorted(range(len(v)), key=lambda i: -v[i]).index(fi) for k, v in scores.items()}
        print(json.dumps({"step": step, "answer": task.answer, "depth": task.depth,
                          "sentences": len(sents), "ranks": ranks}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
