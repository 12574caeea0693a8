"""A forward translator for the MoE pair composed from the dense pair's: small -> dense -> MoE.

SmolLM2-135M-MoE was upcycled from the dense target (weights/build/moe.py): its experts are
copies of the dense MLP and its value projections are the dense ones, so only its keys
differ: healed q/k projections and a k_norm. Its values are the dense target's values, and its
RoPE-free keys *before* the k_norm are a near-linear function of the dense target's keys at
the same layer. So the dense pair's best translator (200 examples, long stage 2 on chat, prose
and technical text) carries over: per layer, fit A_l (ridge) with k_moe ~ k_dense @ A_l on the
same attention inputs (hooked inside the MoE while it reads calibration text), then compose
key maps W_l @ A_l (bias b_l @ A_l), keep the value maps, and use the pre-norm key cut (the
MoE's own k_norm and RoPE finish the keys). A stage-1 *prior* of a related pair, as issue 20
asks, used whole; stage 2 on the MoE pair can continue from it (`python -m weights.build.stage2 --pair moe
--translator FILE`; not done for the shipped file).

    OPENBLAS_NUM_THREADS=1 python -m weights.build.compose_moe --out FILE
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.kv.translator import Side, Translator
from mlx_kvlingo.models.demo.pair import demo_data, demo_models, source_for, translator_path
from mlx_kvlingo.models.files import load_translator, save_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Recorder(nn.Module):
    """Stands in for a k_proj: records its input rows, returns the wrapped projection's output."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.rows = inner, []

    def __call__(self, x):
        self.rows.append(np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)))
        return self.inner(x)


def fit_key_bridges(dense, moe, examples, alpha: float) -> list[np.ndarray]:
    """Per layer A (192 x 192 here): ridge fit of moe.k_proj(x) on dense.k_proj(x)."""
    layers = moe.model.model.layers
    recorders = [Recorder(layer.self_attn.k_proj) for layer in layers]
    for layer, rec in zip(layers, recorders, strict=True):
        layer.self_attn.k_proj = rec
    try:
        with moe_cpu.per_expert_loop():
            for ex in examples:
                mx.eval(moe.model(mx.array(list(ex.prefix))[None]))
    finally:
        for layer, rec in zip(layers, recorders, strict=True):
            layer.self_attn.k_proj = rec.inner
    bridges = []
    for i, rec in enumerate(recorders):
        x = mx.array(np.concatenate(rec.rows))
        kd = np.array(dense.model.model.layers[i].self_attn.k_proj(x), dtype=np.float64)
        km = np.array(rec.inner(x), dtype=np.float64)
        gram = kd.T @ kd
        lam = alpha * np.trace(gram) / len(gram)
        bridges.append(np.linalg.solve(gram + lam * np.eye(len(gram)), kd.T @ km))
    return bridges


def compose(dense_tr: Translator, bridges, moe_side: Side) -> Translator:
    if dense_tr.config.variant != "mixing":
        raise SystemExit("composition is written for mixing translators")
    cfg = replace(dense_tr.config, target=moe_side, key_cut="pre_norm", metadata={})
    tr = Translator(cfg)
    a = mx.array(np.stack(bridges).astype(np.float32))  # (L, Dt, Dt)
    tr.key["weight"] = dense_tr.key["weight"] @ a
    tr.value["weight"] = dense_tr.value["weight"]
    if cfg.bias:
        tr.key["bias"] = (dense_tr.key["bias"][:, None, :] @ a)[:, 0]
        tr.value["bias"] = dense_tr.value["bias"]
    tr.config.metadata["calibration"] = {
        "composed": {
            "from": dense_tr.config.metadata.get("file", "dense default forward translator"),
            "how": "key maps W @ A_l (A_l: ridge k_moe ~ k_dense on the MoE's attention "
            "inputs), value maps kept, pre_norm key cut",
        }
    }
    return tr


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dense-translator", default=None, help="default: the dense pair's default")
    ap.add_argument("--examples", type=int, default=24, help="calibration examples read by the MoE")
    ap.add_argument("--alpha", type=float, default=1e-4, help="ridge, relative to mean eigenvalue")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    dense_path = translator_path(args.dense_translator, pair="dense")  # a path or shipped name
    folder = source_for(str(dense_path), "dense")  # the small model the dense translator reads
    src_dir, dense_dir = demo_models("dense", folder)
    _, moe_dir = demo_models("moe", folder)
    small, dense, moe = load_model(src_dir), load_model(dense_dir), load_model(moe_dir)
    dense_tr = load_translator(dense_path, load_pair(small, dense))
    dense_tr.config.metadata["file"] = Path(dense_path).name
    train, _ = load_examples(
        demo_data()[0], moe.tokenizer, DataConfig(16, 256, 32, 0.02, seed=0, max_examples=200)
    )
    bridges = fit_key_bridges(dense, moe, train[-args.examples :], args.alpha)
    tr = compose(dense_tr, bridges, Side.of(moe.geometry))
    pair = load_pair(small, moe)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_translator(tr, args.out, pair, dtype=mx.float16)
    print(json.dumps({"wrote": str(args.out), "from": Path(dense_path).name}))


if __name__ == "__main__":
    main()
