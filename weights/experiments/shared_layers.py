"""The demo small model's first 8 layers are the large model's own (weights/README.md), so for
target layers 0-7 the exact translation is the identity from the same source layer; the shipped
forward translator (stage 2 trained on the end KL) maps them with relative errors of 0.04-0.19
(keys) and 0.07-0.67 (values) instead. This pins those maps to the identity and compares the
chat's own reading (`eval.content.Chat`) with the shipped translator and the pinned one on the
fact tasks of `kvlingo eval --task content --kinds fact,copy --per-kind 3 --seed 5`.

    python -m weights.experiments.shared_layers 2048,4096 [SHARED] [VARIANTS]

VARIANTS (comma-separated; default `chat,pinned`): `chat` (the shipped translator) or `pinned`,
each optionally with `-share0.3` (another recompute share) and/or `-tail256` (a longer tail the
large model reads itself), e.g. `pinned-share0.3-tail256`.
"""

import copy
import json
import sys

from mlx_kvlingo import load
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.eval.content import Chat, evaluate_content, fitting_tasks, retention, to_json

import mlx.core as mx


def pinned(tr, shared: int):
    """A copy of `tr` whose maps into target layers [0, shared) are the identity from the same
    source layer (zero bias): exact where the two models share their first layers."""
    out = copy.copy(tr)
    for side, rows in (("key", tr.config.key_layers), ("value", tr.config.value_layers)):
        p = dict(getattr(tr, side))
        w, width = p["weight"], p["weight"].shape[-1]
        eye = mx.eye(width, dtype=w.dtype)
        blocks = []
        for t in range(w.shape[0]):
            if t < shared:
                j = rows[t].index(t)
                z = mx.zeros((width, width), dtype=w.dtype)
                blocks.append(mx.concatenate([eye if i == j else z for i in range(len(rows[t]))]))
            else:
                blocks.append(w[t])
        p["weight"] = mx.stack(blocks)
        if "bias" in p:
            p["bias"] = mx.concatenate([mx.zeros_like(p["bias"][:shared]), p["bias"][shared:]])
        setattr(out, side, p)
    return out


lengths = [int(x) for x in sys.argv[1].split(",")]
shared = int(sys.argv[2]) if len(sys.argv) > 2 else 8
loaded = load(warmup=False)
pair, tr = loaded.models, loaded.forward
tasks = fitting_tasks(
    pair, content_texts(None), [1024, 2048, 4096], 3, seed=5, kinds=("fact", "copy")
)
tasks = [t for t in tasks if t.length in lengths and t.kind == "fact"]
variants = (sys.argv[3] if len(sys.argv) > 3 else "chat,pinned").split(",")
exact = pinned(tr, shared)
conditions = {}
for v in variants:
    kw = {}
    for part in v.split("-")[1:]:
        if part.startswith("share"):
            kw["share"] = float(part[5:])
        elif part.startswith("tail"):
            kw["tail"] = int(part[4:])
    conditions[v] = Chat(tr if v.startswith("chat") else exact, **kw)
res = to_json(evaluate_content(pair, tasks, conditions, small=False), pair)
for r in res["records"]:
    print(
        json.dumps(
            {
                k: r[k]
                for k in ("task", "length", "condition", "answer", "correct", "read_s", "reply")
            }
        )
    )
for c in conditions:
    print(c, retention(res, c))
