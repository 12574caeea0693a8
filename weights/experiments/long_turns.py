"""Long turns through the product's own path: per read length, one fresh conversation read by the
large model and one by the small (`Runtime.load`, `Conversation.answer`, default policy
otherwise), each turn's TTFT, its predicted TTFT before the turn, the status line's alternative
after it, and the peak memory beside the two models and both caches. One JSON line per length.

    python -m weights.experiments.long_turns dense 128,512,1024,2048,4096,8192
"""

import json
import sys

from mlx_kvlingo import ReaderPolicy, Runtime
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.data.content_tasks import build_tasks

import mlx.core as mx

pair_name = sys.argv[1]
lengths = [int(x) for x in sys.argv[2].split(",")]
rt = Runtime.load(pair=pair_name)
costs = rt.pair.__dict__.get("_kvlingo_read_costs")
print(json.dumps({"warmup": costs.origin, "warmup_s": costs.warmup_s}), flush=True)
weights = sum(
    v.nbytes
    for m in (rt.pair.source, rt.pair.target)
    for _, v in __import__("mlx.utils").utils.tree_flatten(m.model.parameters())
)
tr_bytes = sum(
    v.nbytes
    for t in (rt.forward, rt.backward)
    if t is not None
    for _, v in __import__("mlx.utils").utils.tree_flatten(t.parameters())
)


def kv_bytes(m, n):
    g = m.geometry
    return 2 * g.layers * g.kv_heads * g.head_dim * n * m.dtype.size


texts = content_texts(None)
for n in lengths:
    (t,) = build_tasks(rt.pair.tokenizer, texts, [min(n, 8100)], 1, kinds=("fact",), seed=11)
    row = {"n": len(t.tokens)}
    for label in ("self", "small"):
        conv = rt.new_conversation(policy=ReaderPolicy(reader=label))
        conv.add_tokens(list(t.tokens))
        mx.reset_peak_memory()
        ev = list(conv.answer(sampling={"temp": 0}, max_tokens=2))[-1]  # the done event
        st = conv._session.last_turn
        row[label] = dict(
            ttft=round(st.ttft_s, 3),
            pred=st.predicted_ttft_s and round(st.predicted_ttft_s, 3),
            alt=st.alternative_ttft_s and round(st.alternative_ttft_s, 3),
            peak_gb=round(mx.get_peak_memory() / 1e9, 3),
            status=ev.status,
        )
        del conv
    N = len(t.tokens)
    row["two_models_two_caches_gb"] = round(
        (weights + tr_bytes + kv_bytes(rt.pair.source, N) + kv_bytes(rt.pair.target, N)) / 1e9, 3
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
