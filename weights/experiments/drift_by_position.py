"""How far the translated cache is from the large model's own, by position, on long turns:
the relative RMS error of the translated keys and values (as the cache holds them) against the
large model's native read of the same tokens, per 512-token bucket and layer third, with the
chat's hand-off (reader small, the large model's 32-token tail, no recompute). If the error
grows with position, what the small model reads drifts from what the translator was calibrated
on (examples of 128-1,024 tokens); if it is flat, a long context loses facts by its size alone.

    python -m weights.experiments.drift_by_position 1024,4096
"""

import json
import sys

from mlx_kvlingo import ReaderPolicy, load
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.conversation.reader import ReadCosts
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.eval.content import fitting_tasks
from mlx_kvlingo.kv.cache import new_cache

import mlx.core as mx

BUCKET = 512
loaded = load(warmup=False)
pair, tr = loaded.models, loaded.forward
lengths = [int(x) for x in sys.argv[1].split(",")]
tasks = fitting_tasks(pair, content_texts(None), lengths, 1, seed=5, kinds=("fact",))
for t in tasks:
    toks = list(t.tokens)
    policy = ReaderPolicy(reader="small", large_reads_last=32, recompute_share=0.0)
    s = Session(pair, tr, policy=policy, read_costs=ReadCosts())
    s.add_tokens(toks)
    s.hand_off("target")
    cut = s.held("target")
    translated = s.cache("target")
    native = new_cache(pair.target)
    pair.target.model(mx.array(toks[:cut])[None], cache=native)
    L = len(native)
    thirds = {
        "low": range(0, L // 3),
        "mid": range(L // 3, 2 * L // 3),
        "deep": range(2 * L // 3, L),
    }
    row = {"len": t.length, "held": cut}
    for kind in ("keys", "values"):
        for name, layers in thirds.items():
            errs = []
            for b in range(1, cut, BUCKET):  # position 0 is the native anchor
                e = min(b + BUCKET, cut)
                num = den = 0.0
                for i in layers:
                    got = getattr(translated[i], kind)[..., b:e, :].astype(mx.float32)
                    want = getattr(native[i], kind)[..., b:e, :].astype(mx.float32)
                    num += mx.sum((got - want) ** 2).item()
                    den += mx.sum(want**2).item()
                errs.append(round((num / den) ** 0.5, 3))
            row[f"{kind}.{name}"] = errs
    print(json.dumps(row), flush=True)
