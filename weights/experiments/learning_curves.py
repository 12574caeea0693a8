"""Stage-1 learning curves: held-out KL against the number of calibration examples, with the
ridge shrinking toward zero (today's fixed alpha, or alpha chosen on held-out documents) and
toward the identity prior (alpha chosen the same way).

Two pairs: the demo pair (8-layer source -> SmolLM2-135M-Instruct, mixing nu = 2 on the
shipped default's layer maps) and a same-geometry pair (SmolLM2 with Gaussian noise of 0.1 x
each layer matrix's std -> SmolLM2, mixing nu = 1). One pass over chitchat training
dialogues; the target is traced once per example for both pairs; the translators are solved
and evaluated whenever the pass reaches a curve size. Alpha is chosen per layer and kind by
the residual on `--validation` training examples from dialogues outside every fit set (the
same for every size and prior); the maps are fitted on exactly N examples.

    OPENBLAS_NUM_THREADS=1 python -m weights.experiments.learning_curves   # writes weights/curves/*
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.calibrate.closed_form import Stage1Accumulator, Stage1Config, document_of
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.eval.evaluate import raw_transfer
from mlx_kvlingo.kv.capture import trace
from mlx_kvlingo.kv.scoring import Prepared, kl, native_logp, student_logp, teacher_inputs
from mlx_kvlingo.models.demo.pair import demo_data, demo_models, translator_path
from mlx_kvlingo.models.demo.smollm2 import cache_root
from mlx_kvlingo.models.files import load_translator, read_metadata
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import numpy as np

WEIGHTS = Path(__file__).resolve().parents[1]
GRID = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1000.0)
LABELS = {
    "zero-fixed": "toward zero, alpha 1e-3 (before)",
    "zero-chosen": "toward zero, alpha chosen",
    "identity-chosen": "toward identity, alpha chosen",
}


def configs(maps) -> dict[str, Stage1Config]:
    given = {"key_layers": maps["key"], "value_layers": maps["value"]}
    return {
        "zero-fixed": Stage1Config(alpha=1e-3, **given),
        "zero-chosen": Stage1Config(alpha_grid=GRID, **given),
        "identity-chosen": Stage1Config(prior="identity", alpha_grid=GRID, **given),
    }


def perturbed_copy(folder: Path, scale: float, seed: int, out: Path) -> Path:
    """A copy of a local model folder whose transformer-layer matrices get Gaussian noise of
    `scale` times each matrix's own standard deviation (embeddings, head and norms unchanged):
    a stand-in for a fine-tune, with the same geometry. Written once, then reused."""
    import shutil

    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    for f in sorted(Path(folder).glob("*.safetensors")):
        weights = mx.load(str(f))
        for k in sorted(weights):
            v = weights[k]
            if ".layers." in k and v.ndim == 2 and mx.issubdtype(v.dtype, mx.floating):
                noise = mx.random.normal(v.shape) * (scale * v.astype(mx.float32).std())
                weights[k] = (v.astype(mx.float32) + noise).astype(v.dtype)
        mx.save_safetensors(str(tmp / f.name), weights, metadata={"format": "mlx"})
    for f in Path(folder).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
    (tmp / "perturbation.json").write_text(json.dumps(
        {"from": str(folder), "scale": scale, "seed": seed,
         "what": "N(0, (scale * std(W))^2) added to every 2-D weight under model.layers"}))  # fmt: skip
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def scores(method, pair, prepared) -> dict:
    """Mean held-out KL(native || translated) and top-1 agreement, token-weighted."""
    kls, agree, n = [], [], []
    for p in prepared:
        logp = student_logp(method, pair, p)
        kls.append(kl(p.teacher_logp, logp).item())
        agree.append(
            float((logp.argmax(-1) == p.teacher_logp.argmax(-1)).astype(mx.float32).mean())
        )
        n.append(p.teacher_logp.shape[0])
    w = np.asarray(n, dtype=float)
    return {"kl": float(np.dot(kls, w) / w.sum()), "agree": float(np.dot(agree, w) / w.sum())}


def render(results: dict, out: Path) -> None:
    """The PNG (one panel per pair) and the markdown table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(results["pairs"])
    fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4.2), squeeze=False)
    lines = ["| pair | examples | " + " | ".join(LABELS.values()) + " | reference |",
             "|---|---|" + "---|" * (len(LABELS) + 1)]  # fmt: skip
    for ax, name in zip(axes[0], pairs):
        r = results["pairs"][name]
        for key, label in LABELS.items():
            pts = [(int(n), c[key]["kl"]) for n, c in r["curve"].items()]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        for ref_name, ref in r["reference"].items():
            ax.axhline(ref["kl"], ls="--", color="gray")
            ax.text(16, ref["kl"], f" {ref_name}", va="bottom", fontsize=8, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("calibration examples")
        ax.set_ylabel("held-out KL(native || translated), nats")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
        ref = "; ".join(f"{k} {v['kl']:.3f}" for k, v in r["reference"].items())
        for n, c in r["curve"].items():
            cells = " | ".join(
                f"{c[k]['kl']:.3f} (agree {c[k]['agree']:.3f})" if k in c else "" for k in LABELS
            )
            lines.append(f"| {name} | {n} | {cells} | {ref} |")
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=110)
    plt.close(fig)
    (out / "learning_curves.md").write_text("\n".join(lines) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--noisy-max", type=int, default=256, help="largest size for the noisy pair")
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--validation", type=int, default=32)
    ap.add_argument("--heldout", type=int, default=20)
    ap.add_argument("--out", type=Path, default=WEIGHTS / "curves")
    ap.add_argument(
        "--only",
        choices=("demo", "noisy"),
        default=None,
        help="run one pair; the other's curve is kept from --out/learning_curves.json",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    src_dir, tgt_dir = demo_models()
    small, large = load_model(src_dir), load_model(tgt_dir)
    noisy_dir = perturbed_copy(tgt_dir, args.noise, 0, out=cache_root() / f"SmolLM2-135M-noise{args.noise:g}-issue20")  # fmt: skip
    noisy = load_model(noisy_dir)
    pairs = {"demo: 8-layer source -> SmolLM2-135M (mixing nu 2)": load_pair(small, large),
             f"SmolLM2 + noise {args.noise:g} -> SmolLM2 (mixing nu 1)": load_pair(noisy, large)}  # fmt: skip
    (demo_name, demo), (noisy_name, noisy_pair) = pairs.items()
    skipped = {"demo": noisy_name, "noisy": demo_name}.get(args.only)
    shipped = translator_path()
    meta = read_metadata(shipped)
    demo_maps = {"key": meta["key_layers"], "value": meta["value_layers"]}
    rows = [[t] for t in range(noisy_pair.target.geometry.layers)]
    cfgs = {demo_name: configs(demo_maps), noisy_name: configs({"key": rows, "value": rows})}
    accs = {name: Stage1Accumulator(pairs[name], list(cfgs[name].values())) for name in pairs}

    train_file, held_file = demo_data()
    dcfg = DataConfig(16, 256, 32, 0.02, seed=0, max_examples=max(sizes) + 4 * args.validation)
    train, _ = load_examples(train_file, demo.tokenizer, dcfg)
    fit = train[: max(sizes)]
    fit_docs = {document_of(e) for e in fit}
    val = [e for e in train[max(sizes) :] if document_of(e) not in fit_docs][: args.validation]
    _, held = load_examples(held_file, demo.tokenizer, DataConfig(16, 256, 32, 1.0, seed=0))
    held = held[: args.heldout]

    # held-out: one teacher (the shared target) and each pair's source span
    prepared = {name: [] for name in pairs}
    for ex in held:
        teacher = native_logp(large, ex)
        for name, pair in pairs.items():
            span = trace(pair.source, list(ex.prefix)[:-1], "post_norm")
            mx.eval(span.keys, span.values, teacher)
            prepared[name].append(Prepared(span, teacher_inputs(ex), teacher))
    results = {
        "command": "python -m weights.experiments.learning_curves " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "data": {"fit": "chitchat-dataset training dialogues, in the loader's order (seed 0)",
                 "validation_examples": len(val), "heldout_examples": len(held),
                 "heldout_tokens": int(sum(len(e.continuation) for e in held)), "alpha_grid": GRID},
        "pairs": {name: {"curve": {}, "reference": {}} for name in pairs},
    }  # fmt: skip
    if skipped:  # keep the other pair's finished curve and say which run made it
        earlier = json.loads((args.out / "learning_curves.json").read_text())
        results["pairs"][skipped] = earlier["pairs"][skipped]
        results["pairs"][skipped]["command"] = earlier["command"]
    if skipped != noisy_name:
        raw = raw_transfer(noisy_pair)
        results["pairs"][noisy_name]["reference"]["raw transfer"] = scores(raw, noisy_pair, prepared[noisy_name])  # fmt: skip
    if skipped != demo_name:
        results["pairs"][demo_name]["reference"]["shipped default"] = scores(
            load_translator(shipped, demo), demo, prepared[demo_name]
        )
    print(json.dumps(results["pairs"], indent=1), flush=True)

    for ex in val:
        t_span = trace(large, ex.prefix + ex.continuation, "post_norm")
        for name in pairs:
            if name != skipped:
                accs[name].add(ex, validation=True, t_span=t_span)
    print(f"validation accumulated ({time.perf_counter() - t0:.0f} s)", flush=True)
    for i, ex in enumerate(fit, 1):
        t_span = trace(large, ex.prefix + ex.continuation, "post_norm")
        for name, pair in pairs.items():
            if name == skipped or (name == noisy_name and i > args.noisy_max):
                continue
            accs[name].add(ex, t_span=t_span)
            if i not in sizes:
                continue
            point = {}
            for key, tr in zip(cfgs[name], accs[name].solve(refit_with_validation=False)):
                point[key] = scores(tr, pair, prepared[name])
                point[key]["alphas"] = tr.config.metadata["calibration"]["stage1"].get("alphas")
            results["pairs"][name]["curve"][str(i)] = point
            summary = {k: round(v["kl"], 4) for k, v in point.items()}
            print(f"{name} N={i}: {summary} ({time.perf_counter() - t0:.0f} s)", flush=True)
            (args.out / "learning_curves.json").write_text(json.dumps(results, indent=1))
            render(results, args.out)
        if i % 32 == 0:
            print(f"  {i} examples ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
