"""Which translated tokens must the target recompute for a stated fact to come back, and does
a selection rule find them? On the content benchmark's fact tasks (dense demo pair):

1. oracle: the target recomputes only the answer's own tokens (and `--window` tokens before
   them) plus the last 32, over the translated rest; is the fact retrieved?
2. selection: the rank of the answer's first token under each rule, among the positions
   before the last 32 (0 = chosen first): the target's attention while reading the last 32
   tokens over the translated cache, in the deeper two thirds of its layers, summed over
   heads, rows and layers or its peak (what `recompute.read_positions` returns); the small
   model's likewise on its own cache; and the translation's error against the native cache
   (an oracle: K/V deviation summed over layers, as CacheBlend selects).

    python -m weights.experiments.recompute_selection --lengths 512,1024 --seed 2
"""

from __future__ import annotations

import argparse

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
import mlx_kvlingo.kv.recompute as rc
from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import MAX_TOKENS, answers_from, contains, native_kv, translated_kv
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo
from mlx_kvlingo.models.files import load_translator

import mlx.core as mx

DEFAULT = "weights/translators/source15/forward-mixing-nu2-content-chat.safetensors"
TAIL = 32


def _answer_at(tokenizer, toks: list[int], answer: str) -> tuple[int, int]:
    ids = tokenizer.encode(" " + answer, add_special_tokens=False)
    for j in range(len(toks) - len(ids) + 1):
        if toks[j : j + len(ids)] == ids:
            return j, len(ids)
    raise ValueError(f"{answer!r} is not in the prompt as its own tokens")


def _weights(model, kv, toks) -> mx.array:
    """Every head's attention while `model` reads the last TAIL tokens on `kv`: (L, H, n, T)."""
    kept = []

    def peak(queries, keys, scale, mask):
        H, Hkv = queries.shape[1], keys.shape[1]
        q = queries.reshape(1, Hkv, H // Hkv, queries.shape[2], queries.shape[3])
        s = mx.where(mask, (q * scale) @ keys[:, :, None].swapaxes(-1, -2), -mx.inf)
        w = mx.softmax(s, axis=-1)[0].reshape(H, queries.shape[2], -1)
        kept.append(w)
        return w.max(axis=(0, 1))

    cache = new_cache(model)
    append_kv(cache, *kv)
    real, rc._attention_peak = rc._attention_peak, peak
    try:
        rc.read_positions(model.model, cache, toks, range(len(toks) - TAIL, len(toks)), True)
    finally:
        rc._attention_peak = real
    return mx.stack(kept)  # the deeper two thirds of the layers (where read_positions looks)


def _rank(score: mx.array, first: int, cut: int) -> int:
    order = mx.argsort(-score[1:cut]).tolist()
    return order.index(first - 1)


def _deviation(t: mx.array, n: mx.array) -> mx.array:
    d = mx.sqrt(((t - n) ** 2).sum(axis=(0, 1, 3)))
    return d / (mx.sqrt((n**2).sum(axis=(0, 1, 3))) + 1e-6)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--translator", default=DEFAULT)
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--per-kind", type=int, default=12)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    a = ap.parse_args(argv)
    pair = load_demo()[0]
    tr = load_translator(a.translator, pair)
    texts = [t for path in demo_content_texts() for t in read_texts(path)]
    lengths = [int(x) for x in a.lengths.split(",")]
    tasks = [t for t in build_tasks(pair.tokenizer, texts, lengths, a.per_kind, ("fact",), a.seed)]
    rules = ("target sum", "target peak", "small sum", "small peak", "K/V deviation")
    print("length | answer | native | translated | answer recomputed | window | ranks: "
          + ", ".join(rules) + " | of")  # fmt: skip
    for task in tasks:
        toks = list(task.tokens[:-1])
        cut = len(toks) - TAIL
        first, n = _answer_at(pair.tokenizer, toks, task.answer)
        tk = translated_kv(pair, tr, toks)
        nk = native_kv(pair.target, toks)
        kvs = [nk, tk]
        for w in (0, a.window):
            cache = new_cache(pair.target)
            append_kv(cache, *tk)
            chosen = [0, *range(max(1, first - w), min(cut, first + n + 2))]
            rc.read_positions(pair.target.model, cache, toks, [*chosen, *range(cut, len(toks))])
            kvs.append(([c.keys[..., : len(toks), :] for c in cache],
                        [c.values[..., : len(toks), :] for c in cache]))  # fmt: skip
        replies = answers_from(pair.target, pair.tokenizer, kvs, task.tokens[-1], MAX_TOKENS["fact"],
                               task.answer)  # fmt: skip
        right = ["yes" if contains(task.answer, r) else "no" for r in replies]
        wt = _weights(pair.target, tk, toks)
        ws = _weights(pair.source, native_kv(pair.source, toks), toks)
        dev = sum(_deviation(t, r) for kind in (0, 1) for t, r in zip(tk[kind], nk[kind]))
        scores = (wt.sum(axis=(0, 1, 2)), wt.max(axis=(0, 1, 2)), ws.sum(axis=(0, 1, 2)),
                  ws.max(axis=(0, 1, 2)), dev)  # fmt: skip
        ranks = [str(_rank(s, first, cut)) for s in scores]
        print(
            f"{task.length} | {task.answer} | {' | '.join(right)} | {', '.join(ranks)} | {cut - 1}"
        )


if __name__ == "__main__":
    main()
