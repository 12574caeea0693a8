"""Experiment: train the small model together with the translator against the target's loss.

The content diagnosis (weights/QUALITY.md, "Content") found that a per-token map of frozen
source K/V cannot write what the target's deep layers add to a token from its context, even
from the target's own first 10 layers. Apple's KV Prediction (apple/corenet,
projects/kv-prediction) trains its auxiliary model *with* the KV predictor, the base model
frozen: loss = base cross-entropy on the predicted cache + the auxiliary model's own
cross-entropy + an L1 term between predicted and base K/V. This does the same on the demo
pair, on the examples `kvlingo calibrate` builds without data (content tasks over the shipped
text, answered by the target on its native cache):

    loss = CE(target on the translated cache -> the target's native answer)
         + aux * CE(source -> its own next prefix token)
         + kv * mean_l |translated K/V - native K/V| / mean |native K/V|

Gradients flow through the target (frozen) into the translated cache, the maps and every
source layer (embeddings frozen: they are the source's tied LM head). Each run is scored by
the content benchmark on the held-out pages (facts, copies, questions at 128 tokens, the
target's native answers as reference) before and after, and by the held-out dialogues' KL
and agreement (the continuation figures the goals keep within 0.02).

    OPENBLAS_NUM_THREADS=1 python -m weights.experiments.joint_source --examples 256 \\
        --steps 400 --out /tmp/joint.json --save /tmp/joint         # source + maps
    ... --examples 256 --ordinary 256 --kv 1.0 --steps 800 --maps-only   # maps only, mixed
    ... --maps-only --source DIR --init FILE    # another source (e.g. the target's first N
                                                # layers, content_diagnosis --write-prefix-source)

Results: weights/QUALITY.md, "Training the maps on the target's answers" (the maps alone
retrieve as many facts as maps and source together).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.content_data import content_examples, shipped_texts
from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.data.examples import DataConfig, load_examples, read_texts
from mlx_kvlingo.eval.content import evaluate_content, summarize
from mlx_kvlingo.kv.capture import OutputRecorder, SpanKV, trace
from mlx_kvlingo.kv.scoring import (
    Prepared,
    heldout_scores,
    kl,
    kv_error,
    native_logp,
    prepare,
    student_logp,
    teacher_inputs,
)
from mlx_kvlingo.models.demo.pair import (
    demo_content_texts,
    demo_data,
    demo_models,
    load_demo,
)
from mlx_kvlingo.models.files import load_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten


def source_span(source, tokens) -> tuple[SpanKV, mx.array]:
    """(RoPE-free K/V of `tokens` for every source layer, the source's logits), in the graph.

    Records k_proj and v_proj outputs during one forward pass without a cache, so gradients
    reach every source layer (`capture.trace` reads a cache and is for frozen models).
    """
    g = source.geometry
    recs = []
    for i in range(g.layers):
        attn = source.attention(i)
        attn.k_proj, attn.v_proj = OutputRecorder(attn.k_proj), OutputRecorder(attn.v_proj)
        recs.append((attn.k_proj, attn.v_proj))
    try:
        logits = source.model(mx.array(tokens)[None])
    finally:
        for i, (k, v) in enumerate(recs):
            attn = source.attention(i)
            attn.k_proj, attn.v_proj = k.inner, v.inner

    def heads(y):  # (1, T, H*D) -> (1, H, T, D)
        return y.reshape(1, -1, g.kv_heads, g.head_dim).transpose(0, 2, 1, 3)

    keys = mx.stack([heads(k.outputs[0]) for k, _ in recs])
    values = mx.stack([heads(v.outputs[0]) for _, v in recs])
    return SpanKV(keys, values, 0, tuple(tokens)), logits[0]


class Joint(nn.Module):
    """The trainable pair: the source model and the translator (the target stays outside)."""

    def __init__(self, source_model, translator):
        super().__init__()
        self.source = source_model
        self.translator = translator


def loss_fn(pair, translator, ex, native, aux: float, kv: float, teacher=None):
    """(total, main term): CE to the target's native answer (content examples) or, given the
    teacher's log-probs (ordinary examples), KL(teacher || student) as stage 2 has it."""
    prefix = list(ex.prefix)
    span, logits = source_span(pair.source, prefix[:-1])
    prep = Prepared(span, teacher_inputs(ex), None)
    logp = student_logp(translator, pair, prep)
    if teacher is None:
        cont = mx.array(list(ex.continuation))
        ce = -mx.take_along_axis(logp, cont[:, None], axis=-1).mean()
    else:
        ce = kl(teacher, logp)
    total = ce
    if aux:
        lp = nn.log_softmax(logits[:-1].astype(mx.float32), axis=-1)
        nxt = mx.array(prefix[1:-1])[:, None]
        total = total + aux * -mx.take_along_axis(lp, nxt, axis=-1).mean()
    if kv:
        total = total + kv * kv_error(translator, Prepared(span, prep.inputs, None, native=native))
    return total, ce


def content_scores(pair, translator, tasks) -> dict:
    res = evaluate_content(pair, tasks, {"translated": translator}, small=True)
    out = {}
    for cond in ("translated", "small"):
        for kind in sorted({t.kind for t in tasks}):
            for length in sorted({t.length for t in tasks}):
                native = [r for r in res.records if r["condition"] == "native"
                          and r["kind"] == kind and r["length"] == length]  # fmt: skip
                mine = [r for r in res.records if r["condition"] == cond
                        and r["kind"] == kind and r["length"] == length]  # fmt: skip
                out[f"{cond} {kind}@{length}"] = summarize(mine, native)
    return {"cells": out, "records": res.records}


def brief(cells: dict) -> str:
    parts = []
    for k, c in cells.items():
        v = c.get("retained", c.get("recall"))
        parts.append(f"{k} {v:.2f}" if v == v else f"{k} -")
    return " · ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=256, help="content examples to train on")
    ap.add_argument("--lengths", default="128,256", help="their read lengths")
    ap.add_argument("--steps", type=int, default=400, help="examples seen (one per step)")
    ap.add_argument("--lr-source", type=float, default=3e-5)
    ap.add_argument("--lr-maps", type=float, default=1e-4)
    ap.add_argument("--aux", type=float, default=0.1, help="weight of the source's own CE")
    ap.add_argument("--kv", type=float, default=0.0, help="weight of the K/V L1 term")
    ap.add_argument(
        "--ordinary",
        type=int,
        default=0,
        help="also train on this many ordinary dialogue examples (KL to the target)",
    )
    ap.add_argument("--maps-only", action="store_true", help="control: the source stays frozen")
    ap.add_argument("--eval-per-kind", type=int, default=6)
    ap.add_argument("--eval-lengths", default="128")
    ap.add_argument("--eval-kinds", default="fact,copy,qa")
    ap.add_argument("--skip-before", action="store_true", help="do not score the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answers", default="/tmp/joint-answers.jsonl", help="answer cache")
    ap.add_argument("--out", default="joint_source.json")
    ap.add_argument("--save", default=None, help="folder for the trained source and maps")
    ap.add_argument("--source", default=None,
                    help="another source model for the demo target (default: the demo's source)")  # fmt: skip
    ap.add_argument("--init", default=None,
                    help="translator to start from (default: the demo's default; needed with --source)")  # fmt: skip
    a = ap.parse_args(argv)

    if a.source and not a.init:
        ap.error("--source needs --init (a translator fitted for that source, e.g. by "
                 "`kvlingo calibrate --steps 0`)")  # fmt: skip
    if a.source:
        pair = load_pair(a.source, demo_models()[1])
        translator = load_translator(a.init, pair)
    else:
        pair, translator = load_demo(a.init)
    t0 = time.perf_counter()
    train = content_examples(pair, shipped_texts(), a.examples,
                             [int(x) for x in a.lengths.split(",")], cache_file=a.answers)  # fmt: skip
    print(f"{len(train)} content examples in {time.perf_counter() - t0:.0f} s", flush=True)
    if a.ordinary:  # the calibration dialogues (the held-out ones below are never among them)
        cfg = DataConfig(max_examples=a.ordinary, max_heldout=0)
        train += load_examples(demo_data()[0], pair.tokenizer, cfg)[0][: a.ordinary]
    held = [prepare(pair, ex, "post_norm")
            for ex in load_examples(demo_data()[1], pair.tokenizer,
                                    DataConfig(heldout_fraction=1.0, max_heldout=16))[1]]  # fmt: skip
    content = [t for p in demo_content_texts() for t in read_texts(p)]
    tasks = build_tasks(pair.tokenizer, content, [int(x) for x in a.eval_lengths.split(",")],
                        a.eval_per_kind, kinds=tuple(a.eval_kinds.split(",")), seed=a.seed)  # fmt: skip
    report = {"args": vars(a), "history": []}

    def score(label):
        t = time.perf_counter()
        kl, agree = heldout_scores(translator, pair, held)
        cs = content_scores(pair, translator, tasks)
        report[label] = {"heldout_kl": kl, "heldout_agree": agree, **cs}
        print(f"[{label}] dialogues KL {kl:.3f} agree {agree:.3f} · {brief(cs['cells'])} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip

    if not a.skip_before:
        score("before")

    joint = Joint(pair.source.model, translator)
    joint.freeze()
    translator.unfreeze()  # its parameters are the key and value maps
    if not a.maps_only:
        for layer in pair.source.model.layers:
            layer.unfreeze()
    n_train = sum(v.size for _, v in tree_flatten(joint.trainable_parameters()))
    print(f"training {n_train / 1e6:.1f} M parameters", flush=True)

    def sched(lr):
        warm = max(a.steps // 20, 1)
        return optim.join_schedules([optim.linear_schedule(0.0, lr, warm),
                                     optim.cosine_decay(lr, a.steps - warm, lr * 0.1)], [warm])  # fmt: skip

    opt = optim.MultiOptimizer(
        [optim.AdamW(sched(a.lr_maps), weight_decay=0.0),
         optim.AdamW(sched(a.lr_source), weight_decay=0.0)],
        [lambda path, _: path.startswith("translator")],
    )  # fmt: skip
    native = {}
    step_fn = nn.value_and_grad(
        joint, lambda ex, nat, teacher: loss_fn(pair, translator, ex, nat, a.aux, a.kv, teacher)
    )
    order = np.random.default_rng(a.seed).permutation(a.steps) % len(train)
    t0, ce_run, kl_run = time.perf_counter(), [], []
    for step, i in enumerate(order, 1):
        ex = train[int(i)]
        if a.kv and i not in native:
            native[i] = trace(pair.target, list(ex.prefix)[:-1], "post_norm")
        ordinary = not ex.source.startswith("content:")
        teacher = native_logp(pair.target, ex) if ordinary else None
        (total, ce), grads = step_fn(ex, native.get(i), teacher)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(joint, grads)
        mx.eval(joint.trainable_parameters(), opt.state, ce)
        (kl_run if ordinary else ce_run).append(ce.item())
        if step % 25 == 0 or step == a.steps:
            rec = {"step": step, "answer_ce": float(np.mean(ce_run[-25:] or [np.nan])),
                   "ordinary_kl": float(np.mean(kl_run[-25:] or [np.nan])),
                   "s": time.perf_counter() - t0}  # fmt: skip
            report["history"].append(rec)
            print(f"step {step}: answer CE {rec['answer_ce']:.3f} · ordinary KL "
                  f"{rec['ordinary_kl']:.3f} ({rec['s']:.0f} s)", flush=True)  # fmt: skip
    score("after")
    if a.save:
        folder = Path(a.save)
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "source.safetensors"),
                            dict(tree_flatten(pair.source.model.parameters())))  # fmt: skip
        from mlx_kvlingo.models.files import save_translator

        save_translator(translator, folder / "translator.safetensors", pair)
    for label in ("before", "after"):
        if label in report:
            report[label]["records"] = [
                {k: r[k] for k in ("condition", "kind", "length", "reply", "answer")}
                for r in report[label]["records"]
            ]  # fmt: skip
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
