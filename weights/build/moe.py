"""Build the demo MoE TARGET's record: SmolLM2-135M-Instruct upcycled exactly into `qwen2_moe`.

    upcycle (mlx_kvlingo/models/demo/moe.py): E copies of each dense MLP, down_proj x E/k,
    a router of logit scale s (0: exact), a zero shared expert, zero q/k/v biases

Nothing is trained and no weights ship: `weights/moe/moe.json` holds the recipe (experts,
top_k, router_scale, seed) and what this step measured for each candidate router scale on
held-out Python documentation windows: the largest |logit| difference from the dense target
(through mlx-lm's own `gather_mm` prefill and through `moe_cpu.per_expert_loop`), greedy tokens
over `--greedy-tokens` steps of chat prompts, and how routed (token, slot) pairs spread over the
experts. The router kept is the largest scale whose logits stay within the zero router's own
float error (its `gather_mm` difference from the dense target) and whose greedy tokens are the
dense target's: exact function, with the routing spread if a scale allows it.

Run from the repo root:  OPENBLAS_NUM_THREADS=1 nice -n 5 python -m weights.build.moe
(step `moe` of `python -m weights.build.rebuild`; a few minutes on two CPU cores)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS; must come before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.models.demo import moe as moe_demo
from mlx_kvlingo.models.demo import pair as demo
from mlx_kvlingo.models.demo import smollm2

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen2_moe

WEIGHTS = Path(__file__).resolve().parents[1]
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a bicycle's gears work.",
    "List ten things to pack for a week of hiking, with a reason for each.",
)
SUMMARY = {
    "upcycled_from": "SmolLM2-135M-Instruct (the demo target as loaded on this platform)",
    "experts": "copies of the dense MLP, down_proj scaled by experts / top_k",
    "shared_expert": "zero weights (adds exactly 0)",
    "attention": "the dense one: GGUF q/k rows, rope_traditional, zero q/k/v biases",
}


def upcycled(dense: dict, config: dict, scale: float, seed: int) -> qwen2_moe.Model:
    model = qwen2_moe.Model(qwen2_moe.ModelArgs.from_dict(config))
    model.load_weights(list(moe_demo.upcycle(dense, config, scale, seed).items()))
    mx.eval(model.parameters())
    return model


def windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the held-out documentation pages."""
    texts = [json.loads(line)["text"] for f in demo.demo_content_texts() for line in f.open()]
    ids = tokenizer.encode("\n\n".join(texts))
    step = max(length, (len(ids) - length) // max(count, 1))
    return [ids[i : i + length] for i in range(0, step * count, step)][:count]


def expert_load(model, x: mx.array) -> list[float]:
    """Share of routed (token, slot) pairs per expert, pooled over the layers."""
    h = model.model.embed_tokens(x)
    mask = "causal"
    counts = np.zeros(model.args.num_experts)
    for layer in model.model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask)
        xm = layer.post_attention_layernorm(h)
        gates = layer.mlp.gate(xm)
        k = layer.mlp.top_k
        inds = np.array(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        counts += np.bincount(inds.ravel(), minlength=len(counts))
        h = h + layer.mlp(xm)
    return (counts / counts.sum()).round(4).tolist()


def greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)  # fmt: skip
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(tok))
    return out


def measure(model, dense, tokenizer, texts, dense_logits, dense_greedy, n) -> dict:
    row = {}
    for label, loop in (("gather_mm", False), ("per_expert_loop", True)):
        with moe_cpu.per_expert_loop(loop):
            diff = max(mx.abs(model(x) - d).max().item() for x, d in zip(texts, dense_logits))
        row[f"max_abs_logit_diff_{label}"] = diff
    with moe_cpu.per_expert_loop():
        same = [greedy(model, tokenizer, p, n) == g for p, g in zip(PROMPTS, dense_greedy)]
        row["greedy_identical"] = f"{sum(same)} of {len(same)} prompts x {n} tokens"
        row["expert_load"] = expert_load(model, texts[0])
    return row


def choose(rows: dict) -> float:
    """The largest scale within the zero router's float error, greedy as the dense target."""
    floor = rows["0.0"]["max_abs_logit_diff_gather_mm"]
    ok = [float(s) for s, r in rows.items()
          if r["max_abs_logit_diff_per_expert_loop"] <= floor and r["greedy_identical"].startswith(f"{len(PROMPTS)} of")]  # fmt: skip
    return max(ok, default=0.0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=WEIGHTS / "moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--scales", default="0,1e-6,1e-5", help="router logit scales tried")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--window-tokens", type=int, default=512)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    t0 = time.time()
    dense_dir = smollm2.ensure_smollm2()
    model, tokenizer, dense_cfg = mlx_lm.load(str(dense_dir), return_config=True)
    config = moe_demo.moe_config(dense_cfg, args.experts, args.top_k)
    texts = [mx.array([w]) for w in windows(tokenizer, args.windows, args.window_tokens)]
    dense_logits = [model(x) for x in texts]
    mx.eval(dense_logits)
    dense_greedy = [greedy(model, tokenizer, p, args.greedy_tokens) for p in PROMPTS]
    print(f"dense target read ({time.time() - t0:.0f} s)", flush=True)
    weights = dict(mx.load(str(dense_dir / "model.safetensors")))
    rows = {}
    for scale in (float(s) for s in args.scales.split(",")):
        moe = upcycled(weights, config, scale, args.seed)
        rows[str(scale)] = measure(moe, model, tokenizer, texts, dense_logits, dense_greedy,
                                   args.greedy_tokens)  # fmt: skip
        print(json.dumps({str(scale): rows[str(scale)]}), flush=True)
        del moe
    scale = choose(rows)
    record = {
        "experts": args.experts, "top_k": args.top_k, "router_scale": scale, "seed": args.seed,
        "summary": {**SUMMARY, "router": f"logit scale {scale:g}" + (" (zero: every expert scores 1/experts)" if scale == 0 else "")},
        "measured": {
            "how": f"{args.windows} held-out Python documentation windows of {args.window_tokens} "
                   f"tokens (logits, expert load of the first); greedy over {len(PROMPTS)} chat "
                   "prompts; float32 on the CPU; router chosen by weights/build/moe.py:choose",
            "by_router_scale": rows,
        },
        "minutes": round((time.time() - t0) / 60, 1),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / moe_demo.RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(f"router scale {scale:g}; wrote {args.out / moe_demo.RECORD}", flush=True)


if __name__ == "__main__":
    main()
