"""Long turns through the product's own path: per read length, one fresh conversation read by the
large model and one by the small (`load`, `stream_generate`, default policy
otherwise), each turn's TTFT, its predicted TTFT before the turn, the status line's alternative
after it, and the peak memory beside the two models and both caches. One JSON line per length.

    python -m weights.experiments.long_turns dense 128,512,1024,2048,4096,8192
"""

import json
import sys

from mlx_kvlingo import ReaderPolicy, load, make_prompt_cache, stream_generate
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.data.content_tasks import build_tasks

import mlx.core as mx

pair_name = sys.argv[1]
lengths = [int(x) for x in sys.argv[2].split(",")]
pair = load(pair=pair_name)
models = pair.models
print(json.dumps({"warmup": pair.rates, "warmup_s": pair.warmup_s}), flush=True)
mem = pair.memory()
weights, tr_bytes = mem["small"] + mem["large"], mem["translators"]


def kv_bytes(m, n):
    g = m.geometry
    return 2 * g.layers * g.kv_heads * g.head_dim * n * m.dtype.size


texts = content_texts(None)
for n in lengths:
    (t,) = build_tasks(pair.tokenizer, texts, [min(n, 8100)], 1, kinds=("fact",), seed=11)
    row = {"n": len(t.tokens)}
    for label in ("self", "small"):
        cache = make_prompt_cache(pair, policy=ReaderPolicy(reader=label))
        mx.reset_peak_memory()
        *_, ev = stream_generate(pair, list(t.tokens), prompt_cache=cache, temp=0, max_tokens=2)
        st = ev.handoff
        row[label] = dict(
            ttft=round(st.ttft_s, 3),
            pred=st.predicted_ttft_s and round(st.predicted_ttft_s, 3),
            alt=st.alternative_ttft_s and round(st.alternative_ttft_s, 3),
            peak_gb=round(mx.get_peak_memory() / 1e9, 3),
            status=ev.status,
        )
        del cache
    N = len(t.tokens)
    row["two_models_two_caches_gb"] = round(
        (weights + tr_bytes + kv_bytes(models.source, N) + kv_bytes(models.target, N)) / 1e9, 3
    )
    row["ratio_small/self"] = round(row["small"]["ttft"] / row["self"]["ttft"], 3)
    row["pred_small/meas"] = row["self"]["alt"] and round(
        row["self"]["alt"] / row["small"]["ttft"], 3
    )
    row["pred_self/meas"] = row["small"]["alt"] and round(
        row["small"]["alt"] / row["self"]["ttft"], 3
    )
    row["first_pred_self/meas"] = row["self"]["pred"] and round(
        row["self"]["pred"] / row["self"]["ttft"], 3
    )
    row["first_pred_small/meas"] = row["small"]["pred"] and round(
        row["small"]["pred"] / row["small"]["ttft"], 3
    )
    print(json.dumps(row), flush=True)
