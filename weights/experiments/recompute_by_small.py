"""Which positions the large model recomputes after a translated turn, chosen by the small
model's attention (it reads the turn natively, the question included) instead of the large
model's reading of the turn's end over the translated cache: the chat condition of the content
benchmark with the selection swapped (`small`), or the larger of both (`both`); or the chat's own
selection (the large model's reading of the tail) plus the first 16 tokens of every 512-token
chunk (`chunks`: EPIC's idea, the chunks being those the small model read). Fact tasks of
`kvlingo eval --task content --seed 5` at the given lengths; one JSON line per task.

    python -m weights.experiments.recompute_by_small 4096 0.1 small
"""

import json
import sys
import time

from mlx_kvlingo import ReaderPolicy, load
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.conversation.reader import ReadCosts
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.eval.content import MAX_TOKENS, answers_from, contains, fitting_tasks
from mlx_kvlingo.kv.cache import append_zeros
from mlx_kvlingo.kv.recompute import (
    Selection,
    attended,
    read_positions,
    sentence_ends,
    special_ids,
    template_positions,
)

import mlx.core as mx

loaded = load(warmup=False)
pair, tr = loaded.models, loaded.forward
lengths = [int(x) for x in sys.argv[1].split(",")]
share = float(sys.argv[2])
mode = sys.argv[3]
tasks = fitting_tasks(
    pair, content_texts(None), [1024, 2048, 4096], 3, seed=5, kinds=("fact", "copy")
)
tasks = [t for t in tasks if t.length in lengths and t.kind == "fact"]
tok = pair.tokenizer
ends, specials = sentence_ends(tok), special_ids(tok)
sel = Selection()
for t in tasks:
    t0 = time.perf_counter()
    toks = list(t.tokens)
    n = len(toks)
    s = Session(
        pair,
        tr,
        policy=ReaderPolicy(reader="small", large_reads_last=32, recompute_share=0.0),
        read_costs=ReadCosts(),
    )
    s.add_tokens(toks)
    s.hand_off("target")
    cut = s.held("target")
    small = s.cache("source")
    sh = s.held("source")
    # the small model reads the rest (but the last token) with its attention recorded
    append_zeros(small, n - 1 - sh)
    mass = read_positions(pair.source.model, small, toks[: n - 1], range(sh, n - 1), attention=True)
    large = s.cache("target")
    rest = toks[cut:-1]
    if mode in ("both", "chunks"):
        append_zeros(large, n - 1 - cut)
        lmass = read_positions(
            pair.target.model, large, toks[: n - 1], range(cut, n - 1), attention=True
        )
        if mode == "chunks":
            mass = lmass
        else:
            mass = mx.maximum(mass / mx.max(mass[:cut]), lmass / mx.max(lmass[:cut]))
    else:
        pair.target.model(mx.array(rest)[None], cache=large)
    skip = template_positions(toks[: n - 1], specials, ends)
    chosen = attended(
        mass, sel.count(share, cut), start=0, end=cut, tokens=toks[: n - 1], ends=ends, skip=skip
    )
    if mode == "chunks":
        chosen = sorted(
            set(chosen) | {p for c in range(1, cut, 512) for p in range(c, min(c + 16, cut))}
        )
    read_positions(pair.target.model, large, toks[: n - 1], chosen)
    keys = [c.keys[..., : c.offset, :] for c in large]
    values = [c.values[..., : c.offset, :] for c in large]
    secs = time.perf_counter() - t0
    (reply,) = answers_from(
        pair.target, tok, [(keys, values)], toks[-1], MAX_TOKENS[t.kind], t.answer
    )
    ans = tok.encode(" " + t.answer, add_special_tokens=False)
    pos = [i for i in range(n - len(ans)) if toks[i : i + len(ans)] == ans]
    print(
        json.dumps(
            {
                "len": t.length,
                "mode": mode,
                "share": share,
                "answer": t.answer,
                "right": contains(t.answer, reply),
                "fact_chosen": [p in set(chosen) for p in pos],
                "s": round(secs, 1),
                "reply": reply[:60],
            }
        ),
        flush=True,
    )
